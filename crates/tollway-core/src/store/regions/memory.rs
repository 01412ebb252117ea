//! The memory store as a [`Board`]: notes kept beside the limits, for a
//! [`SplitStore`](crate::SplitStore) in this process.

use std::collections::HashMap;
use std::time::Duration;

use super::{Board, BoardFuture};
use crate::MemoryStore;
use crate::clock::Clock;

/// The notes posted on one memory store: by topic, with the instant they expire.
#[derive(Default)]
pub(crate) struct MemoryBoard(parking_lot::Mutex<HashMap<String, Notes>>);

struct Notes {
    expires: u64,
    notes: HashMap<Vec<u8>, u64>,
}

/// Notes kept beside the limits, for a [`SplitStore`](crate::SplitStore) in this process:
/// a post adds to its topic's notes, and a topic goes when its last post's `keep` is over.
impl<C: Clock> Board for MemoryStore<C> {
    fn post(&self, topic: &str, notes: Vec<(Vec<u8>, u64)>, keep: Duration) -> BoardFuture<()> {
        let now = self.clock().now_micros();
        let mut board = self.board().0.lock();
        board.retain(|_, kept| kept.expires > now);
        let kept = board.entry(topic.to_owned()).or_insert_with(|| Notes {
            expires: 0,
            notes: HashMap::new(),
        });
        let keep = u64::try_from(keep.as_micros()).unwrap_or(u64::MAX);
        kept.expires = now.saturating_add(keep);
        kept.notes.extend(notes);
        Box::pin(std::future::ready(Ok(())))
    }

    fn read(&self, topic: &str) -> BoardFuture<Vec<(Vec<u8>, u64)>> {
        let now = self.clock().now_micros();
        let board = self.board().0.lock();
        let notes = match board.get(topic) {
            Some(kept) if kept.expires > now => kept
                .notes
                .iter()
                .map(|(name, &n)| (name.clone(), n))
                .collect(),
            _ => Vec::new(),
        };
        Box::pin(std::future::ready(Ok(notes)))
    }
}
