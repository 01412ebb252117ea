//! Regions that each decide against their own store: [`SplitStore`] splits a limit into
//! shares, [`ReplicatedStore`] tells the other regions what it admitted.

mod memory;
mod replicated;
mod split;

pub(crate) use self::memory::MemoryBoard;

pub use self::replicated::{Recording, ReplicatedStore, ReplicatedStoreBuilder};
pub use self::split::{Board, BoardFuture, SplitFuture, SplitStore, SplitStoreBuilder};
