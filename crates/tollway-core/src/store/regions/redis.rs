//! A [`RedisStore`] as a [`Board`]: notes kept in Redis beside the limits.

use std::collections::HashMap;
use std::time::Duration;

use super::{Board, BoardFuture};
use crate::RedisStore;

/// Notes in Redis, for a [`SplitStore`](crate::SplitStore): a hash a topic, under
/// `{prefix}:board:{topic}`.
///
/// A post is written with one `HSET`, and given the post's expiry in the same
/// transaction (`MULTI`/`EXEC`). So a reader sees a post whole or not at all, and it
/// expires. It is read with one `HGETALL`. Both go through the store's connections,
/// within its timeout.
impl Board for RedisStore {
    fn post(&self, topic: &str, notes: Vec<(Vec<u8>, u64)>, keep: Duration) -> BoardFuture<()> {
        if notes.is_empty() {
            return Box::pin(async { Ok(()) });
        }
        let key = format!("{}:board:{topic}", self.prefix());
        let keep = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX).max(1);
        let mut post = redis::pipe();
        post.atomic().cmd("HSET").arg(&key);
        for (name, n) in &notes {
            post.arg(&name[..]).arg(*n);
        }
        post.ignore().cmd("PEXPIRE").arg(&key).arg(keep).ignore();
        let posted = self.pipeline(post);
        Box::pin(async move {
            posted.await?;
            Ok(())
        })
    }

    fn read(&self, topic: &str) -> BoardFuture<Vec<(Vec<u8>, u64)>> {
        let mut hgetall = redis::cmd("HGETALL");
        hgetall.arg(format!("{}:board:{topic}", self.prefix()));
        let read = self.command::<HashMap<Vec<u8>, u64>>(hgetall);
        Box::pin(async move { Ok(read.await?.into_iter().collect()) })
    }
}
