//! The board the regions post their demand on: see [`Board`].

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::StoreError;

/// The future of a [`Board`] call.
pub type BoardFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

/// A region's notice board: where the regions post what they ask of a limit, for each
/// region's [`SplitStore`](crate::SplitStore) to read.
///
/// A post adds its notes to a topic all at once. A note of the same name is replaced. A
/// reader sees every note of a post, or none of them.
///
/// [`MemoryStore`](crate::MemoryStore) implements it, with notes kept beside its limits,
/// for one process. So does the Redis store, with a hash a topic. The hash is written in
/// one transaction with its expiry, and read with one `HGETALL`.
pub trait Board: Send + Sync + 'static {
    /// Adds `notes` (name, value) to `topic`, all at once; the topic is kept for `keep`
    /// after its last post.
    fn post(&self, topic: &str, notes: Vec<(Vec<u8>, u64)>, keep: Duration) -> BoardFuture<()>;

    /// Every note under `topic` (none once it has expired).
    fn read(&self, topic: &str) -> BoardFuture<Vec<(Vec<u8>, u64)>>;
}
