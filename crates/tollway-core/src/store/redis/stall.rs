//! Stalls: Redis stopped answering while calls wait.
//!
//! A loaded Redis answers late but keeps answering: replies to other calls keep coming.
//! A stalled one (`CLIENT PAUSE`, a fork, a dead link) answers nothing. So a store
//! counts time since its last reply of any call. When a call has waited `after` and
//! no reply came in that time, the stall is declared: that call and every call waiting
//! fail at once, to the breaker and its fallback, instead of each waiting its timeout.
//! A process too busy to read its replies is not a stalled Redis: before declaring, the
//! call lets the tasks ahead of it run, and declares nothing if that, or its own timer,
//! was late by a quarter of `after` or more. `after` must exceed the round trip to Redis
//! and its slowest script: one call that takes longer is a stall.
//! A call sent before the stall may still run when Redis comes back: its charge stands.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// The default time without a reply, with a call waiting, that declares a stall.
pub(super) const DEFAULT_STALL_AFTER: Duration = Duration::from_millis(20);

/// A store's watch over its replies.
pub(super) struct Stall {
    after: Duration,
    origin: Instant,
    /// When the last reply came, in µs since `origin`.
    last_reply: AtomicU64,
    /// Bumped at each stall declared: waiting calls see it and fail.
    declared: watch::Sender<u64>,
}

/// The call failed because a stall was declared while it waited.
#[derive(Debug)]
pub(super) struct Stalled;

impl Stall {
    pub(super) fn new(after: Duration) -> Self {
        Stall {
            after,
            origin: Instant::now(),
            last_reply: AtomicU64::new(0),
            declared: watch::channel(0).0,
        }
    }

    /// How long without a reply declares a stall.
    pub(super) fn after(&self) -> Duration {
        self.after
    }

    fn micros(&self, at: Instant) -> u64 {
        u64::try_from(at.duration_since(self.origin).as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether no reply came for `after` since the later of the last reply and
    /// `started` (µs).
    fn silent(&self, started: u64, after: u64) -> bool {
        let since = self.last_reply.load(Ordering::Relaxed).max(started);
        self.micros(Instant::now()).saturating_sub(since) >= after
    }

    /// Waits for `call`, unless a stall is declared first (by this call or another).
    pub(super) async fn wait<F: Future>(&self, call: F) -> Result<F::Output, Stalled> {
        let started = self.micros(Instant::now());
        let after = u64::try_from(self.after.as_micros()).unwrap_or(u64::MAX);
        let mut declared = self.declared.subscribe();
        let mut call = std::pin::pin!(call);
        let mut check = started.saturating_add(after);
        loop {
            let at = self.origin + Duration::from_micros(check);
            tokio::select! {
                biased;
                out = &mut call => {
                    self.last_reply.fetch_max(self.micros(Instant::now()), Ordering::Relaxed);
                    return Ok(out);
                }
                // Another call declared a stall (the sender lives as long as `self`).
                _ = declared.changed() => return Err(Stalled),
                () = tokio::time::sleep_until(at) => {
                    // A busy process may not have read replies that came. Let the tasks
                    // queued before this one run (the connection's among them), twice:
                    // if that took long, the process is what is slow, not Redis.
                    // A timer that fired late says the same.
                    let mut busy = Instant::now().duration_since(at) * 4 >= self.after;
                    if !busy && self.silent(started, after) {
                        let before = Instant::now();
                        for _ in 0..2 {
                            tokio::task::yield_now().await;
                        }
                        busy = before.elapsed() * 4 >= self.after;
                    }
                    if !busy && self.silent(started, after) {
                        self.declared.send_modify(|n| *n += 1);
                        #[cfg(feature = "metrics")]
                        metrics::counter!(crate::metric::STORE_STALLS.name).increment(1);
                        return Err(Stalled);
                    }
                    let since = self.last_reply.load(Ordering::Relaxed).max(started);
                    let now = self.micros(Instant::now());
                    // Busy: look again a quarter of `after` on, not at once.
                    check = since.saturating_add(after).max(now + after / 4);
                }
            }
        }
    }
}
