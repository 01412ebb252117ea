//! Reloading a layer's limits from its file: a [`Follower`] of the file whose first
//! follower is the layer, swapped in whole.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tollway_core::{Clock, ConfigError, Policy, Store};

use super::follow::{Changed, Follower, LiveConfig, Reloaded};
use super::{ConfigKey, LimitsFile};
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};

/// Reloads a layer's limits from its file: on demand ([`reload`](Self::reload)) or when
/// the file changes ([`watch`](Self::watch)).
///
/// It is a [`Follower`] of the file whose first follower is the layer. Clones share the
/// layer. A reload reads and validates the whole file first; only a valid one replaces
/// the running limits, at once for the next request. A file that fails keeps the running
/// limits: [`reload`](Self::reload) returns the error, and it is logged at warn. So does
/// one that changes `[store]` or `[key]`, which a running layer cannot change.
///
/// Run-time shadow switches on the layer outlive a reload (see
/// [`RateLimitLayer::swap_limits`]). A service that reads more of the file follows it
/// through [`follower`](Self::follower).
///
/// # Examples
///
/// ```
/// use tollway_tower::MemoryStore;
/// use tollway_tower::config::Reloader;
///
/// # let dir = std::env::temp_dir().join(format!("tollway-doc-reloader-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir)?;
/// let path = dir.join("limits.toml");
/// std::fs::write(&path, "[layer]\ndefault = \"api\"\n\n\
///     [policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1m\"\n")?;
/// let reloader = Reloader::new(&path, MemoryStore::new())?;
/// assert_eq!(reloader.live().version().len(), 64);
/// assert_eq!(reloader.live().reloads(), 0);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Reloader<St> {
    follower: Follower,
    layer: RateLimitLayer<St, ConfigKey>,
}

/// What a reloader adds to every builder the file makes (closures a file cannot say).
type Extend<St> = Arc<
    dyn Fn(RateLimitLayerBuilder<St, ConfigKey>) -> RateLimitLayerBuilder<St, ConfigKey>
        + Send
        + Sync,
>;

impl<St: Clone> Clone for Reloader<St> {
    fn clone(&self) -> Self {
        Reloader {
            follower: self.follower.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<St> fmt::Debug for Reloader<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloader")
            .field("path", &self.follower.path())
            .finish_non_exhaustive()
    }
}

impl<St: Store + Clone> Reloader<St> {
    /// Reads the file at `path` (bounded as a reload is) and builds its layer over
    /// `store` (from [`LimitsFile::store`], or one of your own), ready to reload.
    ///
    /// # Errors
    ///
    /// When the file cannot be read within the bounds or is not valid.
    pub fn new(path: impl Into<PathBuf>, store: St) -> Result<Self, ConfigError> {
        let follower = Follower::new(path)?;
        Self::following(follower, store, Arc::new(|builder| builder))
    }

    /// The layer of an already read `file` (at `path`) over `store`, ready to reload.
    ///
    /// # Errors
    ///
    /// Never for a file that [`LimitsFile::read`] accepted.
    pub fn from_file(
        path: impl Into<PathBuf>,
        file: LimitsFile,
        store: St,
    ) -> Result<Self, ConfigError> {
        Self::following(
            Follower::from_file(path, file),
            store,
            Arc::new(|builder| builder),
        )
    }

    /// The same, with `extend` applied to the builder of every layer the file makes, now
    /// and on each reload.
    ///
    /// This is for what a file cannot say, such as a cost function, a decision listener
    /// or [`settle`](RateLimitLayerBuilder::settle).
    ///
    /// # Errors
    ///
    /// When the extended builder fails to build (a `settle` naming a policy the file
    /// lacks).
    pub fn from_file_with(
        path: impl Into<PathBuf>,
        file: LimitsFile,
        store: St,
        extend: impl Fn(RateLimitLayerBuilder<St, ConfigKey>) -> RateLimitLayerBuilder<St, ConfigKey>
        + Send
        + Sync
        + 'static,
    ) -> Result<Self, ConfigError> {
        Self::following(Follower::from_file(path, file), store, Arc::new(extend))
    }

    /// The layer of `follower`'s file over `store`, which follows the file from now on.
    fn following(follower: Follower, store: St, extend: Extend<St>) -> Result<Self, ConfigError> {
        let key = follower.with_file(LimitsFile::key)?;
        let builder = follower.with_file(|file| file.builder(store.clone(), key.clone()))?;
        let layer = extend(builder).build()?;
        let running = layer.clone();
        follower.follow_with(Arc::new(move |current, file| {
            current.same_foundations(file)?;
            let mut builder = file.builder(store.clone(), key.clone())?;
            // An unchanged [shed] keeps the running shedder, its calls and what it learnt;
            // a changed one starts from the running limit.
            if let (Some(running), Some(new)) = (running.shed(), file.shed()?) {
                if running.same_settings(&new) {
                    builder = builder.shed(running);
                } else {
                    new.continue_from(&running);
                    builder = builder.shed(new);
                }
            }
            let fresh = extend(builder).build()?;
            let reset = counts_reset(&running.policies(), &fresh.policies());
            let kept = running.swap_limits(fresh)?;
            key.known.store(Arc::new(file.known_keys()));
            Ok(Changed { reset, kept })
        }));
        Ok(Reloader { follower, layer })
    }

    /// The largest file a reload reads, in bytes (1 MiB unless set): a larger one is
    /// refused, the running limits kept.
    #[must_use]
    pub fn max_file_size(mut self, bytes: u64) -> Self {
        self.follower = self.follower.max_file_size(bytes);
        self
    }

    /// How long a reload waits for the file to be read (5 s unless set): past it, the
    /// reload fails and the running limits stay.
    #[must_use]
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.follower = self.follower.read_timeout(timeout);
        self
    }

    /// How long a file written in place must stay the same before the
    /// [watcher](Self::watch) applies it (1 s unless set). A file renamed into place is
    /// whole, and applied at once.
    #[must_use]
    pub fn settle(mut self, settle: Duration) -> Self {
        self.follower = self.follower.settle(settle);
        self
    }

    /// The clock [`settle`](Self::settle) is measured on (the process's monotonic clock
    /// unless set): a test's manual clock decides when a file has settled.
    #[must_use]
    pub fn settle_clock(mut self, clock: impl Clock) -> Self {
        self.follower = self.follower.settle_clock(clock);
        self
    }
}

impl<St> Reloader<St> {
    /// The layer: add it to a router; its limits follow the file.
    #[must_use]
    pub fn layer(&self) -> RateLimitLayer<St, ConfigKey> {
        self.layer.clone()
    }

    /// The follower of the file: [`follow`](Follower::follow) it too, to read more of
    /// each new version than the layer does (tollway-server's descriptors).
    #[must_use]
    pub fn follower(&self) -> &Follower {
        &self.follower
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        self.follower.path()
    }

    /// Runs `read` on the live limits file: the one the last good load or reload read.
    pub fn with_file<R>(&self, read: impl FnOnce(&LimitsFile) -> R) -> R {
        self.follower.with_file(read)
    }

    /// Which file is live, and how its reloads went.
    #[must_use]
    pub fn live(&self) -> LiveConfig {
        self.follower.live()
    }

    /// What [`live`](Self::live) says, each time it changes: a reload applied or failed,
    /// a change the watcher waits to settle. Await `changed()` or `wait_for(..)` on it.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::MemoryStore;
    /// use tollway_tower::config::Reloader;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = std::env::temp_dir().join(format!("tollway-doc-subscribe-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir)?;
    /// let path = dir.join("limits.toml");
    /// let limits = "[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\n";
    /// std::fs::write(&path, format!("{limits}limit = 10\nperiod = \"1m\"\n"))?;
    /// let reloader = Reloader::new(&path, MemoryStore::new())?;
    /// let mut live = reloader.subscribe();
    /// std::fs::write(&path, format!("{limits}limit = 20\nperiod = \"1m\"\n"))?;
    /// reloader.reload().await?;
    /// live.changed().await?;
    /// assert_eq!(live.borrow().reloads(), 1);
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<LiveConfig> {
        self.follower.subscribe()
    }

    /// Reads the file again and, if it is valid, swaps its limits in. The file is read on
    /// a thread of its own, and this waits on a tokio timer at most the
    /// [`read_timeout`](Self::read_timeout).
    ///
    /// A swap is told at info. It is told at warn when a policy's counts start afresh (its
    /// algorithm or period changed), or a run-time switch overrides the file. A failure is told at warn.
    ///
    /// # Errors
    ///
    /// When the file cannot be read in time, is not valid, changes `[store]` or `[key]`,
    /// or holds limits the layer's interceptor cannot apply: the running limits stay.
    pub async fn reload(&self) -> Result<Reloaded, ConfigError> {
        self.follower.reload().await
    }

    /// Reloads whenever the file changes, until the returned watcher is dropped: see
    /// [`Follower::watch`].
    ///
    /// # Errors
    ///
    /// When the operating system's file watcher cannot be set up.
    pub fn watch(&self) -> Result<super::Watcher, ConfigError> {
        self.follower.watch()
    }
}

/// The policies of `new` that `old` has under the same name with another algorithm or
/// period: their state ids change ([`Policy::state_id`]), so their callers start afresh.
/// Each is told at warn. A changed limit or burst keeps what callers used: told at info.
fn counts_reset(old: &[Policy], new: &[Policy]) -> Vec<String> {
    let mut reset = Vec::new();
    for policy in new {
        let Some(was) = old.iter().find(|p| p.name() == policy.name()) else {
            continue;
        };
        if was == policy {
            continue;
        }
        if was.state_id() == policy.state_id() {
            tracing::info!(
                "policy {:?} changed from {} to {}: its callers keep what they used",
                policy.name(),
                describe(was),
                describe(policy),
            );
            continue;
        }
        tracing::warn!(
            "policy {:?} changed from {} to {}: a new algorithm or period starts its \
             callers' counts afresh, so each may use its new limit in full again",
            policy.name(),
            describe(was),
            describe(policy),
        );
        reset.push(policy.name().to_owned());
    }
    reset
}

/// A policy's algorithm and quota, in a few words.
fn describe(policy: &Policy) -> String {
    let quota = policy.quota();
    if let Some(calendar) = quota.calendar() {
        let algorithm = policy.algorithm().name();
        return format!("{algorithm} {} a {calendar}", quota.limit());
    }
    format!(
        "{} {} per {:?} (burst {})",
        policy.algorithm().name(),
        quota.limit(),
        quota.period(),
        quota.burst()
    )
}
