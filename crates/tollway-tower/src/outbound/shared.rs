//! What every clone of an outbound layer and its services share: the limits, the keys,
//! the cost and the pause.

use std::hash::BuildHasher;
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use tollway_core::Policy;

use crate::pipeline::CostFn;
use crate::report::Reporter;

pub(super) type SettleFn = dyn Fn(&StatusCode, &HeaderMap) -> Option<u64> + Send + Sync;

/// Whose budget a request draws on, and whose pause it waits out and starts.
#[derive(Debug)]
pub(super) struct Keys<K, P> {
    pub(super) limits: K,
    /// `None`: the limits' key.
    pub(super) pause: Option<P>,
}

/// What every clone of a layer and its services share.
pub(super) struct Shared<St, R> {
    pub(super) store: St,
    pub(super) policies: Vec<Policy>,
    pub(super) cost: Option<CostFn>,
    pub(super) max_wait: Duration,
    pub(super) jitter: f64,
    pub(super) seeds: std::hash::RandomState,
    /// The pause an upstream's 429 asks of every worker sharing the key: a GCRA of one
    /// unit a millisecond whose capacity is the longest pause (see [`super::pause`]).
    pub(super) pause: Option<Policy>,
    pub(super) settle: Option<Box<SettleFn>>,
    /// Which refused requests go once more.
    pub(super) replay: R,
    /// Tells each decision of the limits, as the server side does.
    pub(super) reporter: Reporter,
}

impl<St, R> Shared<St, R> {
    /// `wait`, stretched by a random share of up to the jitter.
    ///
    /// The share is a hash of the wall-clock instant under this layer's random seed. So
    /// it differs from request to request, and from process to process.
    pub(super) fn jittered(&self, wait: Duration) -> Duration {
        let salt = self.seeds.hash_one(std::time::SystemTime::now());
        let unit = (salt >> 11) as f64 / (1u64 << 53) as f64;
        wait.mul_f64(1.0 + self.jitter * unit)
    }
}
