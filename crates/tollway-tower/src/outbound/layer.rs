//! The layer and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode, Uri};
use tollway_core::{ConfigError, Policy, Store};
use tower_layer::Layer;

use super::keys::{Upstream, UpstreamAccount};
use super::replay::Idempotent;
use super::service::Outbound;
use super::shared::{Keys, SettleFn, Shared};
use crate::pipeline::CostFn;
use crate::report::{DecisionListener, Reporter};

/// The longest pause an upstream can ask for: an hour.
const PAUSE_CEILING: Duration = Duration::from_secs(3_600);

/// Limits outbound requests: see the [module docs](super).
///
/// `K` finds whose budget a request draws on, and `P` whose pause it waits out (both
/// [`KeyExtractor`](crate::KeyExtractor)s); `R` says which refused requests go again.
pub struct OutboundLayer<St, K = Upstream, P = UpstreamAccount, R = Idempotent> {
    shared: Arc<Shared<St, R>>,
    keys: Arc<Keys<K, P>>,
}

impl<St, K, P, R> Clone for OutboundLayer<St, K, P, R> {
    fn clone(&self) -> Self {
        OutboundLayer {
            shared: Arc::clone(&self.shared),
            keys: Arc::clone(&self.keys),
        }
    }
}

impl<St, K, P, R> fmt::Debug for OutboundLayer<St, K, P, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLayer")
            .field("policies", &self.shared.policies)
            .field("max_wait", &self.shared.max_wait)
            .field("jitter", &self.shared.jitter)
            .finish_non_exhaustive()
    }
}

impl<St: Store> OutboundLayer<St> {
    /// A builder limiting requests by `policy` in `store`, keyed per upstream
    /// ([`Upstream`]), and pausing per upstream and account ([`UpstreamAccount`]).
    pub fn builder(store: St, policy: Policy) -> OutboundLayerBuilder<St> {
        OutboundLayerBuilder {
            keys: Keys {
                limits: Upstream,
                pause: Some(UpstreamAccount),
            },
            settings: Settings {
                store,
                policies: vec![policy],
                cost: None,
                max_wait: Duration::from_secs(30),
                jitter: 0.1,
                max_pause: Duration::from_secs(60),
                settle: None,
                listener: None,
            },
            replay: Idempotent,
        }
    }
}

impl<S, St, K, P, R> Layer<S> for OutboundLayer<St, K, P, R> {
    type Service = Outbound<S, St, K, P, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Outbound::new(inner, Arc::clone(&self.shared), Arc::clone(&self.keys))
    }
}

/// Builds an [`OutboundLayer`].
#[must_use]
pub struct OutboundLayerBuilder<St, K = Upstream, P = UpstreamAccount, R = Idempotent> {
    settings: Settings<St>,
    keys: Keys<K, P>,
    replay: R,
}

/// Everything a builder sets but the keys and which requests to send again.
struct Settings<St> {
    store: St,
    policies: Vec<Policy>,
    cost: Option<CostFn>,
    max_wait: Duration,
    jitter: f64,
    max_pause: Duration,
    settle: Option<Box<SettleFn>>,
    listener: Option<Arc<dyn DecisionListener>>,
}

impl<St, K, P, R> fmt::Debug for OutboundLayerBuilder<St, K, P, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLayerBuilder")
            .field("policies", &self.settings.policies)
            .field("max_wait", &self.settings.max_wait)
            .field("jitter", &self.settings.jitter)
            .field("max_pause", &self.settings.max_pause)
            .finish_non_exhaustive()
    }
}

impl<St: Store, K, P, R> OutboundLayerBuilder<St, K, P, R> {
    /// Another limit every request must also fit (all or nothing, as on the server
    /// side): say 100 requests a second and 10,000 a day.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.settings.policies.push(policy);
        self
    }

    /// Whose budget a request draws on: any [`KeyExtractor`](crate::KeyExtractor), as on
    /// the server side. The default is [`Upstream`]: every upstream has its own budget.
    ///
    /// Key by the account as well to keep one budget per account. A request with no key
    /// goes unlimited. An upstream's 429 then pauses the requests of this key, unless
    /// [`pause_key`](Self::pause_key) says otherwise.
    pub fn key<K2>(self, key: K2) -> OutboundLayerBuilder<St, K2, P, R> {
        OutboundLayerBuilder {
            settings: self.settings,
            keys: Keys {
                limits: key,
                pause: None,
            },
            replay: self.replay,
        }
    }

    /// Whose requests an upstream's 429 pauses: any
    /// [`KeyExtractor`](crate::KeyExtractor). A pause holds the requests with the same
    /// pause key.
    ///
    /// The default is [`UpstreamAccount`]: one account's 429 does not pause the others.
    /// After [`key`](Self::key), the default is that key. A request with no pause key
    /// is never paused.
    pub fn pause_key<P2>(self, key: P2) -> OutboundLayerBuilder<St, K, P2, R> {
        OutboundLayerBuilder {
            settings: self.settings,
            keys: Keys {
                limits: self.keys.limits,
                pause: Some(key),
            },
            replay: self.replay,
        }
    }

    /// How many units a request costs (default 1; a cost of 0 counts as 1).
    pub fn cost(
        mut self,
        cost: impl Fn(&Method, &Uri, &HeaderMap) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.settings.cost = Some(Arc::new(cost));
        self
    }

    /// The longest a request waits for the limit in all (default 30 s); one that would
    /// wait longer fails with [`OutboundError::Limited`](super::OutboundError::Limited) at once.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.settings.max_wait = max_wait;
        self
    }

    /// Never waits: a request over the limit fails at once with
    /// [`OutboundError::Limited`](super::OutboundError::Limited) (a `max_wait` of zero).
    pub fn fail_fast(self) -> Self {
        self.max_wait(Duration::ZERO)
    }

    /// How much longer than the retry time a waiting request may sleep, as a share of it.
    ///
    /// The share is chosen at random per request. The default is 0.1: up to 10% more. So
    /// the workers refused together do not all come back at the same instant.
    pub fn jitter(mut self, share: f64) -> Self {
        self.settings.jitter = share;
        self
    }

    /// The longest an upstream's 429 pauses the workers sharing its key (default 60 s;
    /// at most an hour; zero: a 429 pauses nobody). See [`super::pause_of`] for how a
    /// `Retry-After` becomes a pause.
    pub fn max_pause(mut self, max_pause: Duration) -> Self {
        self.settings.max_pause = max_pause;
        self
    }

    /// Settles what a request really cost once its response says so: `settle` reads the
    /// response's status and headers and returns the units used (say an LLM API's
    /// tokens), or `None` to keep the estimate. The difference from the estimate the
    /// request was charged ([`cost`](Self::cost)) is charged or refunded; what a charge
    /// cannot take is owed by a bucket or GCRA (see the [module docs](super)).
    pub fn settle(
        mut self,
        settle: impl Fn(&StatusCode, &HeaderMap) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.settings.settle = Some(Box::new(settle));
        self
    }

    /// Hears every decision of the limits, as on the server side (see
    /// [`DecisionListener`]): a request that waits is told at each check, `limited`
    /// until one lets it through. The caller's key is `outbound:` and the request's key
    /// (`outbound:upstream:api.example.com`). A running pause is told as `limited`, with
    /// the pause policy's decision.
    /// The debug event and the metrics (feature `metrics`) tell the same decisions.
    pub fn on_decision(mut self, listener: impl DecisionListener) -> Self {
        self.settings.listener = Some(Arc::new(listener));
        self
    }

    /// Which requests the upstream refused are sent once more, after the pause its 429
    /// asks for, if that pause ends within what is left of
    /// [`max_wait`](Self::max_wait): [`Idempotent`] by default (copies of `GET`, `PUT`,
    /// `DELETE`… whose body is `Clone`), [`NoReplay`](super::NoReplay), or a closure
    /// (see [`Replay`](super::Replay)). The copy is checked against the limits and charged like any
    /// request; the refused one keeps its charge. A request goes at most twice; when the
    /// second cannot go within `max_wait` (or the store fails meanwhile), the caller gets
    /// the upstream's 429. With no pausing (`max_pause` zero) nothing is sent again.
    pub fn replay<R2>(self, replay: R2) -> OutboundLayerBuilder<St, K, P, R2> {
        OutboundLayerBuilder {
            settings: self.settings,
            keys: self.keys,
            replay,
        }
    }

    /// Builds the layer.
    ///
    /// # Errors
    ///
    /// When the jitter is not a share from 0 to 1, or the longest pause is over an hour.
    pub fn build(self) -> Result<OutboundLayer<St, K, P, R>, ConfigError> {
        if !(0.0..=1.0).contains(&self.settings.jitter) {
            return Err(ConfigError::new(format!(
                "outbound jitter must be a share from 0 to 1 (0.1: up to 10% longer than the retry time); got {}",
                self.settings.jitter
            )));
        }
        if self.settings.max_pause > PAUSE_CEILING {
            return Err(ConfigError::new(format!(
                "outbound max_pause must be at most an hour; got {:?}",
                self.settings.max_pause
            )));
        }
        for policy in &self.settings.policies {
            self.settings.store.supports(policy)?;
        }
        let pause = super::pause::policy(self.settings.max_pause)?;
        let Settings {
            store,
            policies,
            cost,
            max_wait,
            jitter,
            settle,
            listener,
            ..
        } = self.settings;
        let reporter = Reporter::new(listener, &policies);
        Ok(OutboundLayer {
            shared: Arc::new(Shared {
                store,
                policies,
                cost,
                max_wait,
                jitter,
                seeds: std::hash::RandomState::new(),
                pause,
                settle,
                replay: self.replay,
                reporter,
            }),
            keys: Arc::new(self.keys),
        })
    }
}
