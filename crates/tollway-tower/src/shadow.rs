//! Which of a layer's limits are in shadow mode: decided and counted, never enforced.

use std::sync::atomic::{AtomicBool, Ordering};

/// Which limits are in shadow mode: decided and counted, never enforced.
///
/// They are switched at run time, so each is a flag. What the builder said is kept
/// beside it. So a switch can be told from the built setting, and carried over a swap
/// of limits.
#[derive(Debug)]
pub(crate) struct Shadow {
    /// The whole layer.
    layer: AtomicBool,
    /// Each policy, by its index in the layer's limits.
    policies: Box<[AtomicBool]>,
    /// The whole layer, as built.
    built_layer: bool,
    /// Each policy, as built.
    built: Box<[bool]>,
}

impl Shadow {
    pub(crate) fn new(layer: bool, policies: impl Iterator<Item = bool>) -> Self {
        let built: Box<[bool]> = policies.collect();
        Shadow {
            layer: AtomicBool::new(layer),
            policies: built.iter().copied().map(AtomicBool::new).collect(),
            built_layer: layer,
            built,
        }
    }

    /// What the builder said of the whole layer (`None`) or of the policy at `index`.
    pub(crate) fn built(&self, index: Option<usize>) -> bool {
        index.map_or(self.built_layer, |i| self.built[i])
    }

    /// Switches the whole layer (`None`) or the policy at `index`.
    pub(crate) fn set(&self, index: Option<usize>, on: bool) {
        match index {
            None => self.set_layer(on),
            Some(i) => self.set_policy(i, on),
        }
    }

    pub(crate) fn set_layer(&self, on: bool) {
        self.layer.store(on, Ordering::Relaxed);
    }

    pub(crate) fn set_policy(&self, index: usize, on: bool) {
        self.policies[index].store(on, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn layer(&self) -> bool {
        self.layer.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn policy(&self, index: usize) -> bool {
        self.policies[index].load(Ordering::Relaxed)
    }
}
