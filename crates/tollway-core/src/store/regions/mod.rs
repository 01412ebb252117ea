//! Regions that each decide against their own store: [`SplitStore`] splits a limit into
//! shares, [`ReplicatedStore`] tells the other regions what it admitted.

mod board;
mod memory;
mod replicated;
mod split;

#[cfg(feature = "redis")]
mod redis;

pub use self::board::{Board, BoardFuture};
pub(crate) use self::memory::MemoryBoard;
pub use self::replicated::{Recording, ReplicatedStore, ReplicatedStoreBuilder};
pub use self::split::{SplitFuture, SplitStore, SplitStoreBuilder};

use crate::StoreError;
use crate::store::Operation;

/// Whether something remote is failing, so that its failures are logged at warn once
/// when they start and once when they end, not on every try.
#[derive(Debug, Default)]
struct Failing(std::sync::atomic::AtomicBool);

impl Failing {
    /// Notes a failure: `true` when it starts an outage.
    fn failed(&self) -> bool {
        !self.0.swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    /// Notes a success: `true` when it ends an outage.
    fn answered(&self) -> bool {
        self.0.swap(false, std::sync::atomic::Ordering::Relaxed)
    }
}

/// The error of an operation a region's store refuses, if `operation` is one: a reset
/// or a refund would act on one region only.
fn one_region_only(store: &str, operation: Operation) -> Option<StoreError> {
    let what = match operation {
        Operation::Reset => "a reset",
        Operation::Refund(_) => "a refund",
        Operation::Peek(_) | Operation::Charge(_) | Operation::Drain(_) => return None,
    };
    Some(StoreError::new(
        crate::StoreErrorKind::Other,
        format!(
            "{what} on a {store} would change this region's state only, and the other \
             regions would undo it: apply it to each region's own store"
        ),
    ))
}
