//! Regions that each decide against their own store: [`SplitStore`] splits a limit into
//! shares, [`ReplicatedStore`] tells the other regions what it admitted.

mod board;
mod replicated;
mod split;

#[cfg(feature = "redis")]
mod redis;

pub use self::board::{Board, BoardFuture};
pub use self::replicated::{Recording, ReplicatedStore, ReplicatedStoreBuilder};
pub use self::split::{SplitFuture, SplitStore, SplitStoreBuilder};
