//! Load shedding: an adaptive limit on the service's own calls in flight, with
//! priorities.
//!
//! Per-key limits stop a few callers who send too much. They do not stop 100,000
//! addresses that each send a little, nor a rush of real users. A [`Shed`] guards the
//! service itself. It counts the calls the service is answering and refuses the ones over
//! its limit at once: no key, no store call, a body of static bytes.
//!
//! The limit follows the service's latency (a gradient rule, below), between a floor and a
//! ceiling. Requests are sorted into [`Priority`]s; each may count on its share of the
//! limit. When the service is full, the least important requests over their share are
//! refused first, and a priority within its share is never refused. One address takes
//! at most a part of a priority's share (below), so one caller cannot hold it.
//!
//! A refused request gets `503 Service Unavailable` with `Retry-After` (over gRPC,
//! `UNAVAILABLE`). That is not a caller's own `429`: it says the service is full, not that
//! this caller sent too much.
//!
//! # The rule
//!
//! The limit moves once a window (a second by default, at least ten calls). The window's
//! median latency is compared with a baseline: the lowest of the first ten windows, then
//! a slow moving average. Within `tolerance` times the baseline, the limit grows by its
//! square root; above it, it shrinks in proportion (at most by half). Changes are smoothed
//! (a fifth a window), and a window in which the service was less than half busy leaves the
//! limit alone. This is Netflix concurrency-limits' `Gradient2` rule, on the median
//! where `Gradient2` takes the average: a few slow clients cannot move a median. It was
//! chosen over AIMD because it reacts to latency as it rises, before calls time out or
//! fail; AIMD waits for drops, which come when the service is already lost.
//!
//! A call is in flight from its admission to the service's answer (its headers). A long
//! streamed body does not hold the service's limit: limit streams per caller with
//! [`Algorithm::Concurrency`](tollway_core::Algorithm::Concurrency). A request waiting for
//! the store, a tier lookup or a shaping delay holds its place, but its latency is timed
//! from the call to the service. A call whose client gave up counts its time so far; a
//! call a limit refused, or the service failed, counts none.
//!
//! The baseline is learnt, not measured unloaded: a service loaded from its first
//! second learns that latency as its baseline.
//!
//! # Priorities
//!
//! With a limit of 100 and shares `checkout` 0.4 and `paying` 0.4 (`other`: 0.2):
//!
//! - 40 checkout calls are always admitted, and 40 paying ones.
//! - Beyond its share, a request is admitted while the calls in flight, plus what the more
//!   important priorities have not used of their shares, stay under the limit.
//!
//! So `other` borrows only what checkout and paying leave, and is refused first. Once
//! every priority more important than it is over its share, priorities borrowing beyond
//! their shares are admitted in the order they come.
//!
//! The limit is soft by what was lent. A priority that was idle while others borrowed its
//! share gets it back at once: in flight may then pass the limit until the borrowed calls
//! end (at most twice the limit).
//!
//! # What a client can do to it
//!
//! A call holds its place from admission to the service's answer. A handler that reads
//! the request's body waits for the client to send it: a client that sends its body
//! slowly, or never, holds its place that long.
//!
//! - **One address holds at most a part of a priority's share**: a quarter by default
//!   ([`ShedBuilder::per_address`]), at least one call. Its calls beyond that borrow like
//!   any call over its share, from what the more important shares leave, and hold no
//!   place in the share. So slow bodies from one address leave the rest of the share to
//!   everyone else. The address is the one the layer's key extractor knows the caller by
//!   (the client behind trusted proxies), else the peer, IPv6 grouped by /64. Behind a
//!   proxy the layer does not trust, every client is the proxy: its calls past the part
//!   borrow too. A request with no address known has no part.
//! - **Its time does not move the limit**: the rule takes each window's median, which a
//!   few slow calls cannot move.
//! - **A body timeout bounds the wait.** Put one beside the shedder, so that a body
//!   never sent ends the call (tower-http's `RequestBodyTimeoutLayer`, below).
//! - **A priority is won by a known value.** [`Match::header_value`] and
//!   [`Match::header_in`] (a tier's API keys) take a request by what it carries. A
//!   header's presence alone ([`Match::header_present`]) is claimable: any client can send
//!   it. Match one only when a layer before this one checked it.
//!
//! Many addresses (a botnet) can each hold their part. The body timeout and a limit on
//! connections before the service bound that; the shedder alone does not.
//!
//! # Examples
//!
//! ```
//! use http::Method;
//! use tollway_tower::shed::{Match, Priority, Shed};
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let shed = Shed::builder()
//!     .limits(20, 1_000)
//!     .priority(
//!         Priority::new("checkout", 0.5)
//!             .when(Match::route(Some(Method::POST), "/api/v1/checkout")?),
//!     )
//!     .priority(Priority::new("paying", 0.3).when(Match::header_in(
//!         http::HeaderName::from_static("x-api-key"),
//!         ["pro-key-1", "pro-key-2"],
//!     )))
//!     .build()?;
//! let per_caller = Policy::new("api", Algorithm::Gcra, Quota::per_minute(600)?)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), per_caller)
//!     .shed(shed.clone())
//!     .build()?;
//! assert_eq!(shed.limit(), 20);
//! # let _ = layer;
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```
//!
//! With a body timeout beside it, in an axum router: a body not sent within 10 s ends
//! the call, and its place in the shedder.
//!
//! ```
//! use std::time::Duration;
//!
//! use axum::{Router, routing::post};
//! use tower_http::timeout::RequestBodyTimeoutLayer;
//! use tollway_tower::shed::Shed;
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let per_caller = Policy::new("api", Algorithm::Gcra, Quota::per_minute(600)?)?;
//! let limits = RateLimitLayer::builder(MemoryStore::new(), per_caller)
//!     .shed(Shed::builder().build()?)
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/api/v1/checkout", post(|body: String| async move { body.len().to_string() }))
//!     .layer(limits)
//!     .layer(RequestBodyTimeoutLayer::new(Duration::from_secs(10)));
//! # let _ = app;
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```

mod gradient;
mod priority;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::Request;
use parking_lot::Mutex;
use tollway_core::{Clock, ConfigError, MonotonicClock};

use crate::key::Key;
use gradient::{Gradient, Settings};
pub use priority::{Match, Priority};

/// The name of the priority of requests that fit no other.
pub const OTHER: &str = "other";

/// The limit's floor unless set.
pub(crate) const FLOOR: u32 = 20;
/// The limit's ceiling unless set.
pub(crate) const CEILING: u32 = 1_000;
/// Calls a window needs unless set.
pub(crate) const MIN_CALLS: u32 = 10;

/// Priorities a shedder may have, `other` included.
const MAX_PRIORITIES: usize = 16;

/// The part of a priority's share one address holds unless set.
pub(crate) const PER_ADDRESS: f64 = 0.25;

/// An adaptive limit on a service's calls in flight, with priorities: see the
/// [module docs](self).
///
/// A handle: clones share one limit. Give it to
/// [`RateLimitLayerBuilder::shed`](crate::RateLimitLayerBuilder::shed).
#[derive(Clone)]
pub struct Shed(Arc<Inner>);

struct Inner {
    settings: Settings,
    /// The part of a priority's share one address may hold.
    per_address: f64,
    /// The builder's priorities, then `other`.
    priorities: Box<[Priority]>,
    shadow: AtomicBool,
    built_shadow: bool,
    /// `Retry-After` of a refusal: the window, in whole seconds, at least 1.
    retry_after: u64,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    #[cfg(feature = "metrics")]
    metrics: metrics_impl::Metrics,
}

struct State {
    gradient: Gradient,
    in_flight: u32,
    partitions: Box<[Partition]>,
    /// Calls holding a place in a priority's share, by priority and address.
    held: HashMap<(usize, Key), u32>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Partition {
    /// Every call of the priority in flight.
    in_flight: u32,
    /// Those holding a place in its share; the others borrow.
    sharing: u32,
    admitted: u64,
    shed: u64,
    would_shed: u64,
}

/// How a call is let in: within its priority's share, or borrowing beyond it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    Sharing,
    Borrowing,
    Refused,
}

/// One priority as it stands: see [`Shed::priorities`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PriorityState {
    /// Its name.
    pub name: String,
    /// Its share of the limit.
    pub share: f64,
    /// Its calls in flight.
    pub in_flight: u32,
    /// Requests admitted, since the shedder was built.
    pub admitted: u64,
    /// Requests refused.
    pub shed: u64,
    /// Requests that shadow mode let through and would have refused.
    pub would_shed: u64,
}

/// Builds a [`Shed`]; every setting is checked by [`build`](Self::build).
#[must_use]
pub struct ShedBuilder {
    settings: Settings,
    per_address: f64,
    priorities: Vec<Priority>,
    shadow: bool,
    clock: Option<Arc<dyn Clock>>,
}

impl Shed {
    /// Starts a shedder: limit 20 at first, between 20 and 1,000, tolerance 1.5, windows
    /// of one second, no priorities but `other`.
    pub fn builder() -> ShedBuilder {
        ShedBuilder {
            settings: Settings {
                initial: FLOOR,
                floor: FLOOR,
                ceiling: CEILING,
                tolerance: 1.5,
                window: 1_000_000,
                min_samples: MIN_CALLS,
                long_windows: 600,
                smoothing: 0.2,
            },
            per_address: PER_ADDRESS,
            priorities: Vec::new(),
            shadow: false,
            clock: None,
        }
    }

    /// The limit now, in calls at once.
    #[must_use]
    pub fn limit(&self) -> u32 {
        self.0.state.lock().gradient.limit()
    }

    /// Calls in flight now.
    #[must_use]
    pub fn in_flight(&self) -> u32 {
        self.0.state.lock().in_flight
    }

    /// Each priority as it stands, the most important first, `other` last.
    #[must_use]
    pub fn priorities(&self) -> Vec<PriorityState> {
        let state = self.0.state.lock();
        self.0
            .priorities
            .iter()
            .zip(state.partitions.iter())
            .map(|(priority, p)| PriorityState {
                name: priority.name.clone(),
                share: priority.share,
                in_flight: p.in_flight,
                admitted: p.admitted,
                shed: p.shed,
                would_shed: p.would_shed,
            })
            .collect()
    }

    /// Puts the shedder in shadow mode (it counts what it would refuse, and refuses
    /// nothing), or takes it out.
    pub fn set_shadow(&self, on: bool) {
        self.0.shadow.store(on, Ordering::Relaxed);
    }

    /// Whether it is in shadow mode.
    #[must_use]
    pub fn is_shadow(&self) -> bool {
        self.0.shadow.load(Ordering::Relaxed)
    }

    /// Whether `other` was built with the same settings, priorities and shadow mode.
    /// A [`Reloader`](crate::config::Reloader) keeps the running shedder then.
    #[must_use]
    pub fn same_settings(&self, other: &Shed) -> bool {
        self.0.settings == other.0.settings
            && self.0.per_address == other.0.per_address
            && self.0.built_shadow == other.0.built_shadow
            && self.0.priorities == other.0.priorities
    }

    /// Starts this shedder at `previous`'s limit and baseline, within its own floor and
    /// ceiling: for a shedder that replaces another with new settings. Calls in flight
    /// through `previous` are not counted here.
    pub fn continue_from(&self, previous: &Shed) {
        if Arc::ptr_eq(&self.0, &previous.0) {
            return;
        }
        let learnt = previous.0.state.lock().gradient.clone();
        let now = self.0.clock.now_micros();
        let mut state = self.0.state.lock();
        state.gradient.continue_from(&self.0.settings, &learnt, now);
    }

    /// Admits `request`, from `address` (when it is known), or refuses it because the
    /// service is full.
    pub(crate) fn admit<B>(
        &self,
        request: &Request<B>,
        address: Option<Key>,
    ) -> Result<Permit, Overloaded> {
        let inner = &*self.0;
        let last = inner.priorities.len() - 1;
        let priority = inner.priorities[..last]
            .iter()
            .position(|p| p.takes(request))
            .unwrap_or(last);
        let (admission, shadow) = {
            let mut state = inner.state.lock();
            let admission = state.admits(priority, address.as_ref(), inner);
            let shadow = inner.shadow.load(Ordering::Relaxed);
            let partition = &mut state.partitions[priority];
            // Shadow mode lets a refused request in, borrowing.
            let how = match admission {
                Admission::Refused if !shadow => {
                    partition.shed += 1;
                    None
                }
                Admission::Refused => {
                    partition.would_shed += 1;
                    Some(Admission::Borrowing)
                }
                admitted => Some(admitted),
            };
            if let Some(how) = how {
                partition.in_flight += 1;
                partition.admitted += 1;
                if how == Admission::Sharing {
                    partition.sharing += 1;
                    if let Some(address) = &address {
                        *state.held.entry((priority, address.clone())).or_insert(0) += 1;
                    }
                }
                state.in_flight += 1;
                let in_flight = state.in_flight;
                state.gradient.in_flight(in_flight);
            }
            (admission, shadow)
        };
        if admission == Admission::Refused {
            let name = &inner.priorities[priority].name;
            tracing::debug!(priority = %name, shadow, "load shed");
            #[cfg(feature = "metrics")]
            inner.metrics.shed(priority, shadow);
            if !shadow {
                return Err(Overloaded {
                    retry_after: inner.retry_after,
                });
            }
        }
        #[cfg(feature = "metrics")]
        inner.metrics.in_flight(priority, 1.0, || self.limit());
        Ok(Permit {
            shed: self.clone(),
            priority,
            sharing: (admission == Admission::Sharing).then_some(address),
            start: inner.clock.now_micros(),
            timed: true,
        })
    }

    /// A call of `priority` that started at `start` has ended: timed (its latency, or
    /// its time so far, is a sample) or not. `sharing` is its address when it held a
    /// place in its priority's share.
    fn release(&self, priority: usize, sharing: Option<Option<Key>>, start: u64, timed: bool) {
        let inner = &*self.0;
        let now = timed.then(|| inner.clock.now_micros());
        let changed = {
            let mut state = inner.state.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            let partition = &mut state.partitions[priority];
            partition.in_flight = partition.in_flight.saturating_sub(1);
            if let Some(address) = sharing {
                partition.sharing = partition.sharing.saturating_sub(1);
                if let Some(address) = address {
                    let entry = (priority, address);
                    if let Some(held) = state.held.get_mut(&entry) {
                        *held -= 1;
                        if *held == 0 {
                            state.held.remove(&entry);
                        }
                    }
                }
            }
            let in_flight = state.in_flight;
            now.and_then(|now| {
                let latency = now.saturating_sub(start);
                state
                    .gradient
                    .sample(&inner.settings, now, latency, in_flight)
            })
        };
        #[cfg(feature = "metrics")]
        inner.metrics.in_flight(priority, -1.0, || self.limit());
        if let Some(limit) = changed {
            tracing::debug!(limit, "load shedding limit");
            #[cfg(feature = "metrics")]
            inner.metrics.limit(limit);
        }
    }
}

impl State {
    /// How a request of the priority at `p`, from `address`, may come in now.
    fn admits(&self, p: usize, address: Option<&Key>, inner: &Inner) -> Admission {
        let priorities = &inner.priorities;
        let limit = self.gradient.limit();
        // A hair over, so that 0.2 of 100 is 20 whatever the float sums came to.
        let guaranteed = |q: usize| (priorities[q].share * f64::from(limit) + 1e-6) as u32;
        // One address holds at most its part of the share, at least one call.
        let within_part = address.is_none_or(|address| {
            let part = ((f64::from(guaranteed(p)) * inner.per_address + 1e-6) as u32).max(1);
            self.held
                .get(&(p, address.clone()))
                .is_none_or(|&held| held < part)
        });
        if within_part && self.partitions[p].sharing < guaranteed(p) {
            return Admission::Sharing;
        }
        // What the more important priorities may still count on is not lent. A call
        // borrows beyond its share, or beyond its address's part of it, from the rest;
        // it holds no place in the share, which stays its priority's.
        let reserved: u32 = (0..p)
            .map(|q| guaranteed(q).saturating_sub(self.partitions[q].sharing))
            .sum();
        if self.in_flight.saturating_add(reserved) < limit {
            Admission::Borrowing
        } else {
            Admission::Refused
        }
    }
}

impl ShedBuilder {
    /// The limit's floor and ceiling, in calls at once (defaults 20 and 1,000). The
    /// limit starts at the floor unless [`initial`](Self::initial) says otherwise.
    pub fn limits(mut self, floor: u32, ceiling: u32) -> Self {
        self.settings.floor = floor;
        self.settings.ceiling = ceiling;
        self.settings.initial = floor;
        self
    }

    /// The limit to start at (default: the floor).
    pub fn initial(mut self, initial: u32) -> Self {
        self.settings.initial = initial;
        self
    }

    /// How much slower than the baseline the service may answer before the limit
    /// shrinks (default 1.5; at least 1).
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.settings.tolerance = tolerance;
        self
    }

    /// How often the limit moves (default: a second), and how many calls a window needs
    /// before it counts (default 10).
    pub fn window(mut self, window: Duration, min_calls: u32) -> Self {
        self.settings.window = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        self.settings.min_samples = min_calls;
        self
    }

    /// The part of a priority's share one address may hold (default a quarter; at
    /// least one call, whatever the part). Its calls beyond it borrow like any call
    /// over its share, and hold no place in the share. So a client holding calls open
    /// (a body sent slowly) leaves the rest of the share to everyone else. 1 lets one
    /// address take a whole share.
    pub fn per_address(mut self, part: f64) -> Self {
        self.per_address = part;
        self
    }

    /// Adds a priority, less important than those added before it.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priorities.push(priority);
        self
    }

    /// Starts in shadow mode: counts what it would refuse, refuses nothing.
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// Measures latency with `clock` (default: [`MonotonicClock`]). A test's manual clock
    /// or [`TokioClock`](crate::TokioClock) under a paused runtime make it deterministic.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// The shedder.
    ///
    /// # Errors
    ///
    /// When a floor is 0 or above the ceiling, the initial limit is outside them, the
    /// tolerance is under 1, the window is empty, the part per address is outside
    /// (0, 1], a share is outside 0..=1 or the shares add up to more than 1, a name is
    /// empty, repeated or `other`, or there are more than 15 priorities.
    pub fn build(self) -> Result<Shed, ConfigError> {
        let s = &self.settings;
        let bad = |why: String| Err(ConfigError::new(format!("load shedding: {why}")));
        if s.floor == 0 || s.floor > s.ceiling {
            return bad(format!(
                "the floor ({}) must be at least 1 and at most the ceiling ({})",
                s.floor, s.ceiling
            ));
        }
        if !(s.floor..=s.ceiling).contains(&s.initial) {
            return bad(format!(
                "the initial limit ({}) must be between the floor ({}) and the ceiling ({})",
                s.initial, s.floor, s.ceiling
            ));
        }
        if !s.tolerance.is_finite() || s.tolerance < 1.0 {
            return bad(format!(
                "the tolerance ({}) must be at least 1: write 1.5 for latency up to 1.5 \
                 times the baseline",
                s.tolerance
            ));
        }
        if !(self.per_address > 0.0 && self.per_address <= 1.0) {
            return bad(format!(
                "per_address ({}) is the part of a priority's share one address may hold: \
                 write a fraction above 0, at most 1 (0.25 by default)",
                self.per_address
            ));
        }
        if s.window == 0 || s.min_samples == 0 {
            return bad("a window must last some time and need at least one call".to_owned());
        }
        if self.priorities.len() >= MAX_PRIORITIES {
            return bad(format!("at most {} priorities", MAX_PRIORITIES - 1));
        }
        let mut total = 0.0;
        for (i, p) in self.priorities.iter().enumerate() {
            if p.name.is_empty() || p.name == OTHER {
                return bad(format!(
                    "a priority needs a name other than {OTHER:?} (requests that fit no \
                     priority are {OTHER:?})"
                ));
            }
            if self.priorities[..i].iter().any(|q| q.name == p.name) {
                return bad(format!("priority {:?} is named twice", p.name));
            }
            if !(0.0..=1.0).contains(&p.share) {
                return bad(format!(
                    "priority {:?} has share {}: write a fraction of the limit, 0 to 1",
                    p.name, p.share
                ));
            }
            if p.matches.is_empty() {
                return bad(format!(
                    "priority {:?} matches no request: give it a route or a header",
                    p.name
                ));
            }
            total += p.share;
        }
        if total > 1.0 + 1e-9 {
            return bad(format!(
                "the shares add up to {total}: they are fractions of one limit, at most 1"
            ));
        }
        let mut priorities = self.priorities;
        priorities.push(Priority::new(OTHER, (1.0 - total).max(0.0)));
        let clock = self
            .clock
            .unwrap_or_else(|| Arc::new(MonotonicClock::new()));
        let now = clock.now_micros();
        let retry_after = s.window.div_ceil(1_000_000).max(1);
        Ok(Shed(Arc::new(Inner {
            state: Mutex::new(State {
                gradient: Gradient::new(s.initial, now),
                in_flight: 0,
                partitions: vec![Partition::default(); priorities.len()].into(),
                held: HashMap::new(),
            }),
            #[cfg(feature = "metrics")]
            metrics: metrics_impl::Metrics::new(&priorities),
            priorities: priorities.into(),
            settings: self.settings,
            per_address: self.per_address,
            shadow: AtomicBool::new(self.shadow),
            built_shadow: self.shadow,
            retry_after,
            clock,
        })))
    }
}

impl fmt::Debug for Shed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shed")
            .field("limit", &self.limit())
            .field("settings", &self.0.settings)
            .field("per_address", &self.0.per_address)
            .field("priorities", &self.0.priorities)
            .field("shadow", &self.is_shadow())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for ShedBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShedBuilder")
            .field("settings", &self.settings)
            .field("priorities", &self.priorities)
            .finish_non_exhaustive()
    }
}

/// A call admitted by a [`Shed`], counted until it is dropped.
///
/// Dropped as it is, the call was given up (its client went away, a timeout): its time
/// so far is a sample, at least what the service would have taken. A slow service whose
/// callers all give up still lowers the limit.
pub(crate) struct Permit {
    shed: Shed,
    priority: usize,
    /// Its address when it holds a place in its priority's share (the address itself
    /// may be unknown); `None` when it borrows.
    sharing: Option<Option<Key>>,
    start: u64,
    /// Whether its time is a sample of the service's latency.
    timed: bool,
}

impl Permit {
    /// The service is called now: its latency counts from here, not from admission
    /// (a store's answer, a tier lookup or a shaping delay is not the service's time).
    pub(crate) fn calling(&mut self) {
        self.start = self.shed.0.clock.now_micros();
    }

    /// The service answered: the call's latency is a sample of the limit's rule.
    pub(crate) fn answered(self) {}

    /// The call ended without the service's answer (a limit refused it, or the service
    /// failed): its time says nothing of the service's latency.
    pub(crate) fn discard(mut self) {
        self.timed = false;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shed
            .release(self.priority, self.sharing.take(), self.start, self.timed);
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("priority", &self.shed.0.priorities[self.priority].name)
            .finish_non_exhaustive()
    }
}

/// A request refused because the service is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Overloaded {
    /// Seconds to wait, for `Retry-After`.
    pub(crate) retry_after: u64,
}

#[cfg(feature = "metrics")]
mod metrics_impl {
    use std::sync::OnceLock;

    use tollway_core::metric;

    use super::Priority;

    /// The shedder's gauges and counters, registered on first use and kept.
    pub(super) struct Metrics {
        names: Box<[String]>,
        limit: OnceLock<metrics::Gauge>,
        in_flight: Box<[OnceLock<metrics::Gauge>]>,
        /// Refused, then would have been refused, a priority.
        shed: Box<[[OnceLock<metrics::Counter>; 2]]>,
    }

    impl Metrics {
        pub(super) fn new(priorities: &[Priority]) -> Self {
            metric::describe();
            Metrics {
                names: priorities.iter().map(|p| p.name.clone()).collect(),
                limit: OnceLock::new(),
                in_flight: priorities.iter().map(|_| OnceLock::new()).collect(),
                shed: priorities.iter().map(|_| Default::default()).collect(),
            }
        }

        /// The limit's gauge, set to `limit` when first used. A shedder that never
        /// admits (one a reload built to compare) never sets it.
        fn limit_gauge(&self, limit: impl FnOnce() -> u32) -> &metrics::Gauge {
            self.limit.get_or_init(|| {
                let gauge = metrics::gauge!(metric::SHED_LIMIT.name);
                gauge.set(f64::from(limit()));
                gauge
            })
        }

        pub(super) fn limit(&self, limit: u32) {
            self.limit_gauge(|| limit).set(f64::from(limit));
        }

        pub(super) fn in_flight(&self, priority: usize, change: f64, limit: impl FnOnce() -> u32) {
            self.limit_gauge(limit);
            let name = &self.names[priority];
            self.in_flight[priority]
                .get_or_init(
                    || metrics::gauge!(metric::SHED_IN_FLIGHT.name, "priority" => name.clone()),
                )
                .increment(change);
        }

        pub(super) fn shed(&self, priority: usize, shadow: bool) {
            let name = &self.names[priority];
            self.shed[priority][usize::from(shadow)]
                .get_or_init(|| {
                    metrics::counter!(
                        metric::SHED.name,
                        "priority" => name.clone(),
                        "shadow" => if shadow { "true" } else { "false" }
                    )
                })
                .increment(1);
        }
    }
}
