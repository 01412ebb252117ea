//! The layer, its builder, the service and its error.

use std::error::Error;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Method, Request, StatusCode, Uri};
use tollway_core::{ConfigError, Policy, Store, StoreError};
use tower_layer::Layer;
use tower_service::Service;

use super::future::ResponseFuture;
use super::replay::{Idempotent, Replay};

type KeyFn = dyn Fn(&Method, &Uri, &HeaderMap) -> Option<String> + Send + Sync;
type CostFn = dyn Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync;
pub(super) type SettleFn = dyn Fn(&StatusCode, &HeaderMap) -> Option<u32> + Send + Sync;

/// The longest pause an upstream can ask for: an hour.
const PAUSE_CEILING: Duration = Duration::from_secs(3_600);

/// What every clone of a layer and its services share.
pub(super) struct Shared<St, R> {
    pub(super) store: St,
    pub(super) policies: Vec<Policy>,
    key: Box<KeyFn>,
    /// Whose pause a 429 starts and a request waits out; `None`: the limits' key.
    pause_key: Option<Box<KeyFn>>,
    cost: Option<Box<CostFn>>,
    pub(super) max_wait: Duration,
    jitter: f64,
    seeds: std::hash::RandomState,
    /// The pause an upstream's 429 asks of every worker sharing the key: a GCRA of one
    /// unit a millisecond whose capacity is the longest pause (see [`super::pause`]).
    pub(super) pause: Option<Policy>,
    pub(super) settle: Option<Box<SettleFn>>,
    /// Which refused requests go once more.
    pub(super) replay: R,
}

impl<St, R> Shared<St, R> {
    /// `wait`, stretched by a random share of up to the jitter: the share is a hash of
    /// the wall-clock instant under this layer's random seed, so it differs from request
    /// to request and from process to process.
    pub(super) fn jittered(&self, wait: Duration) -> Duration {
        let salt = self.seeds.hash_one(std::time::SystemTime::now());
        let unit = (salt >> 11) as f64 / (1u64 << 53) as f64;
        wait.mul_f64(1.0 + self.jitter * unit)
    }
}

/// Limits outbound requests: see the [module docs](super).
pub struct OutboundLayer<St, R = Idempotent> {
    shared: Arc<Shared<St, R>>,
}

impl<St, R> Clone for OutboundLayer<St, R> {
    fn clone(&self) -> Self {
        OutboundLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St, R> fmt::Debug for OutboundLayer<St, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLayer")
            .field("policies", &self.shared.policies)
            .field("max_wait", &self.shared.max_wait)
            .field("jitter", &self.shared.jitter)
            .finish_non_exhaustive()
    }
}

impl<St: Store> OutboundLayer<St> {
    /// A builder limiting requests by `policy` in `store`, keyed per upstream, and
    /// pausing per upstream and account (see [`pause_key`](OutboundLayerBuilder::pause_key)).
    pub fn builder(store: St, policy: Policy) -> OutboundLayerBuilder<St> {
        OutboundLayerBuilder {
            settings: Settings {
                store,
                policies: vec![policy],
                key: Box::new(|_, uri, _| {
                    Some(uri.authority().map_or("", |a| a.as_str()).to_owned())
                }),
                pause_key: Some(Box::new(|_, uri, headers| {
                    Some(super::pause::account_key(uri, headers))
                })),
                cost: None,
                max_wait: Duration::from_secs(30),
                jitter: 0.1,
                max_pause: Duration::from_secs(60),
                settle: None,
            },
            replay: Idempotent,
        }
    }
}

impl<S, St, R> Layer<S> for OutboundLayer<St, R> {
    type Service = Outbound<S, St, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Outbound {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Builds an [`OutboundLayer`].
#[must_use]
pub struct OutboundLayerBuilder<St, R = Idempotent> {
    settings: Settings<St>,
    replay: R,
}

/// Everything a builder sets but which requests to send again.
struct Settings<St> {
    store: St,
    policies: Vec<Policy>,
    key: Box<KeyFn>,
    pause_key: Option<Box<KeyFn>>,
    cost: Option<Box<CostFn>>,
    max_wait: Duration,
    jitter: f64,
    max_pause: Duration,
    settle: Option<Box<SettleFn>>,
}

impl<St, R> fmt::Debug for OutboundLayerBuilder<St, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLayerBuilder")
            .field("policies", &self.settings.policies)
            .field("max_wait", &self.settings.max_wait)
            .field("jitter", &self.settings.jitter)
            .field("max_pause", &self.settings.max_pause)
            .finish_non_exhaustive()
    }
}

impl<St: Store, R> OutboundLayerBuilder<St, R> {
    /// Another limit every request must also fit (all or nothing, as on the server
    /// side): say 100 requests a second and 10,000 a day.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.settings.policies.push(policy);
        self
    }

    /// Whose budget a request draws on, from its method, URI and headers (default: the
    /// URI's authority, `api.example.com`, so every upstream has its own). Return the
    /// account or API key as well to keep one budget per account; `None` sends the
    /// request unlimited. An upstream's 429 then pauses the requests of this key (unless
    /// [`pause_key`](Self::pause_key) says otherwise).
    pub fn key(
        mut self,
        key: impl Fn(&Method, &Uri, &HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.settings.key = Box::new(key);
        self.settings.pause_key = None;
        self
    }

    /// Whose requests an upstream's 429 pauses, from the refused request's method, URI
    /// and headers; the requests a pause holds are those with the same pause key. The
    /// default is the upstream and the account the request names: the URI's authority,
    /// and a digest of the first of [`ACCOUNT_HEADERS`](super::ACCOUNT_HEADERS) it
    /// carries (`Authorization`, `X-API-Key`, `Api-Key`). So one account's 429 does not
    /// pause the others, and the credentials never reach the store. A request naming no
    /// account is paused per upstream. After [`key`](Self::key), the default is that key.
    /// `None`: the request is never paused.
    pub fn pause_key(
        mut self,
        key: impl Fn(&Method, &Uri, &HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.settings.pause_key = Some(Box::new(key));
        self
    }

    /// How many units a request costs (default 1).
    pub fn cost(
        mut self,
        cost: impl Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync + 'static,
    ) -> Self {
        self.settings.cost = Some(Box::new(cost));
        self
    }

    /// The longest a request waits for the limit in all (default 30 s); one that would
    /// wait longer fails with [`OutboundError::Limited`] at once.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.settings.max_wait = max_wait;
        self
    }

    /// Never waits: a request over the limit fails at once with
    /// [`OutboundError::Limited`] (a `max_wait` of zero).
    pub fn fail_fast(self) -> Self {
        self.max_wait(Duration::ZERO)
    }

    /// How much longer than the retry time a waiting request may sleep, as a share of
    /// it, chosen at random per request (default 0.1: up to 10% more), so that the
    /// workers refused together do not all come back at the same instant.
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
        settle: impl Fn(&StatusCode, &HeaderMap) -> Option<u32> + Send + Sync + 'static,
    ) -> Self {
        self.settings.settle = Some(Box::new(settle));
        self
    }

    /// Which requests the upstream refused are sent once more, after the pause its 429
    /// asks for, if that pause ends within what is left of
    /// [`max_wait`](Self::max_wait): [`Idempotent`] by default (copies of `GET`, `PUT`,
    /// `DELETE`… whose body is `Clone`), [`NoReplay`](super::NoReplay), or a closure
    /// (see [`Replay`]). The copy is checked against the limits and charged like any
    /// request; the refused one keeps its charge. A request goes at most twice; when the
    /// second cannot go within `max_wait` (or the store fails meanwhile), the caller gets
    /// the upstream's 429. With no pausing (`max_pause` zero) nothing is sent again.
    pub fn replay<R2>(self, replay: R2) -> OutboundLayerBuilder<St, R2> {
        OutboundLayerBuilder {
            settings: self.settings,
            replay,
        }
    }

    /// Builds the layer.
    ///
    /// # Errors
    ///
    /// When the jitter is not a share from 0 to 1, or the longest pause is over an hour.
    pub fn build(self) -> Result<OutboundLayer<St, R>, ConfigError> {
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
            key,
            pause_key,
            cost,
            max_wait,
            jitter,
            settle,
            ..
        } = self.settings;
        Ok(OutboundLayer {
            shared: Arc::new(Shared {
                store,
                policies,
                key,
                pause_key,
                cost,
                max_wait,
                jitter,
                seeds: std::hash::RandomState::new(),
                pause,
                settle,
                replay: self.replay,
            }),
        })
    }
}

/// The service an [`OutboundLayer`] makes around a client.
pub struct Outbound<S, St, R = Idempotent> {
    inner: S,
    shared: Arc<Shared<St, R>>,
}

impl<S: Clone, St, R> Clone for Outbound<S, St, R> {
    fn clone(&self) -> Self {
        Outbound {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, St, R> fmt::Debug for Outbound<S, St, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbound")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, R, B, RB> Service<Request<B>> for Outbound<S, St, R>
where
    S: Service<Request<B>, Response = http::Response<RB>> + Clone,
    S::Error: Into<Box<dyn Error + Send + Sync>>,
    St: Store,
    R: Replay<B> + Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = Box<dyn Error + Send + Sync>;
    type Future = ResponseFuture<S, St, B, R>;

    /// Always ready: a request may wait for the limit first, and holding the inner
    /// service's readiness meanwhile would starve it. The future makes its own clone of
    /// the inner service ready once the request is admitted.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let shared = &self.shared;
        let (method, uri, headers) = (request.method(), request.uri(), request.headers());
        let key = (shared.key)(method, uri, headers);
        // Only a layer that pauses needs it, and only for a request it limits.
        let pause = match (&shared.pause, &key) {
            (Some(_), Some(key)) => match &shared.pause_key {
                Some(pause_key) => pause_key(method, uri, headers),
                None => Some(key.clone()),
            },
            _ => None,
        };
        let cost = shared
            .cost
            .as_ref()
            .map_or(1, |cost| cost(method, uri, headers));
        let keys = Keys { limits: key, pause };
        ResponseFuture::new(self.inner.clone(), Arc::clone(shared), keys, cost, request)
    }
}

/// A request's keys: whose budget it draws on, and whose pause it waits out and starts.
#[derive(Debug)]
pub(super) struct Keys {
    /// `None`: not limited (nor paused).
    pub(super) limits: Option<String>,
    /// `None`: never paused (always so when not limited, or the layer never pauses).
    pub(super) pause: Option<String>,
}

/// Why the limiter itself failed an outbound request (the inner service's own errors
/// pass through as they are). Downcast the service's boxed error to tell.
#[derive(Debug)]
#[non_exhaustive]
pub enum OutboundError {
    /// Over the limit for longer than the request may wait: the same request fits in
    /// `retry_after`.
    Limited {
        /// When the limit would admit the request.
        retry_after: Duration,
    },
    /// The request costs more than a limit holds at once: it never fits.
    CostExceedsCapacity,
    /// A memory store holding its bound of keys refused a new one.
    StoreFull,
    /// The store failed (Redis down, a timeout): nothing was sent.
    Store(StoreError),
}

impl fmt::Display for OutboundError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OutboundError::Limited { retry_after } => write!(
                f,
                "outbound rate limit reached: the request fits in {retry_after:?}, longer than it may wait"
            ),
            OutboundError::CostExceedsCapacity => {
                f.write_str("the request costs more than the outbound limit holds at once")
            }
            OutboundError::StoreFull => {
                f.write_str("the limiter's store is full and refused a new key")
            }
            OutboundError::Store(e) => write!(f, "the outbound limiter's store failed: {e}"),
        }
    }
}

impl Error for OutboundError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            OutboundError::Store(e) => Some(e),
            _ => None,
        }
    }
}
