//! Following a limits file: read bounded, on a thread of its own and within a timeout;
//! validated; handed whole to what follows it; what is live told.

use std::fmt;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tollway_core::{Clock, ConfigError, MonotonicClock};

use super::LimitsFile;
use crate::rate_limit::ShadowState;

/// The largest limits file a follower reads, by default, and [`LimitsFile::read`]
/// always: 1 MiB.
pub(super) const MAX_FILE_SIZE: u64 = 1 << 20;
/// How long a read of the limits file may take, by default.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a file written in place must stay the same before the watcher applies it,
/// by default.
const SETTLE: Duration = Duration::from_secs(1);

/// Follows a limits file: reads it again on demand ([`reload`](Self::reload)) or when it
/// changes ([`watch`](Self::watch)), and hands each valid new version to what follows it
/// ([`follow`](Self::follow)).
///
/// A reload reads and validates the whole file first, and hands it on only when it is
/// valid. A file that fails keeps the running one: [`reload`](Self::reload) returns the
/// error, and it is logged at warn. What follows the file may refuse it too (a layer
/// whose interceptor cannot apply it, say); then it stays the running one as well.
///
/// The file is read on a thread of its own, never on the async workers: a regular file
/// of at most [`max_file_size`](Self::max_file_size) bytes, within
/// [`read_timeout`](Self::read_timeout). A FIFO or a device in its place is refused, and
/// a read that hangs (a stalled network mount) fails at the timeout; no other read starts
/// until it ends.
///
/// [`live`](Self::live) tells which file is live: its SHA-256, when it was loaded, how
/// many reloads worked and failed. With the feature `metrics`:
/// `tollway_config_reloads_total` and `tollway_config_reload_errors_total` count them,
/// `tollway_config_info{version}` is 1 for the live file's SHA-256, and
/// `tollway_config_loaded_timestamp_seconds` is when it was loaded.
///
/// A [`Reloader`](super::Reloader) is a follower whose first follower is a layer; a
/// service that reads more of the file (tollway-server's descriptors) follows it too.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use tollway_tower::config::Follower;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = std::env::temp_dir().join(format!("tollway-doc-follower-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir)?;
/// let path = dir.join("limits.toml");
/// let limits = "[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\n";
/// std::fs::write(&path, format!("{limits}limit = 10\nperiod = \"1m\"\n"))?;
/// let follower = Follower::new(&path)?;
/// let seen = Arc::new(AtomicU64::new(0));
/// let counted = Arc::clone(&seen);
/// follower.follow(move |file| {
///     counted.store(file.policy_names().count() as u64, Ordering::SeqCst);
///     Ok(())
/// });
/// std::fs::write(&path, format!("{limits}limit = 20\nperiod = \"1m\"\n"))?;
/// follower.reload().await?;
/// assert_eq!(seen.load(Ordering::SeqCst), 1);
/// assert_eq!(follower.live().reloads(), 1);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Follower {
    pub(super) path: PathBuf,
    current: Arc<Mutex<LimitsFile>>,
    followers: Arc<Mutex<Vec<Apply>>>,
    pub(super) bounds: Bounds,
    pub(super) live: Arc<Live>,
}

/// What follows a file: puts a new version (the second) in force over the running one
/// (the first), or refuses it.
pub(super) type Apply =
    Arc<dyn Fn(&LimitsFile, &LimitsFile) -> Result<Changed, ConfigError> + Send + Sync>;

/// What putting a new version in force changed, for [`Reloaded`].
#[derive(Default)]
pub(super) struct Changed {
    pub(super) reset: Vec<String>,
    pub(super) kept: Vec<ShadowState>,
}

/// How a follower reads its file, and how long a file written in place must settle.
#[derive(Clone)]
pub(super) struct Bounds {
    max_size: u64,
    timeout: Duration,
    pub(super) settle: Duration,
    pub(super) clock: Arc<dyn Clock>,
}

/// What the follower's clones share: the live file's description (sent to every
/// [`subscribe`](Follower::subscribe)r as it changes), and whether a read is under way.
pub(super) struct Live {
    reading: Arc<AtomicBool>,
    pub(super) state: watch::Sender<LiveConfig>,
}

/// A limits file read: its version (the SHA-256 of its bytes) and what validating it
/// said.
pub(super) struct Read {
    pub(super) version: String,
    file: Result<LimitsFile, ConfigError>,
}

/// Which limits file is live, and how its reloads went: from [`Follower::live`].
#[derive(Clone, Debug)]
pub struct LiveConfig {
    path: PathBuf,
    version: String,
    loaded_at: SystemTime,
    reloads: u64,
    failures: u64,
    last_error: Option<String>,
    pub(super) pending: Option<String>,
}

impl LiveConfig {
    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The live file's version: the SHA-256 of its bytes, in hex (what `sha256sum` prints).
    #[must_use]
    pub fn version(&self) -> &str {
        &self.version
    }

    /// When the live file was loaded.
    #[must_use]
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    /// The reloads that swapped a file in, since the start.
    #[must_use]
    pub fn reloads(&self) -> u64 {
        self.reloads
    }

    /// The reloads that failed (the running file stayed), since the start.
    #[must_use]
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The error of the last reload, if it failed.
    #[must_use]
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The version of a file the watcher has seen change and waits to settle, if any.
    #[must_use]
    pub fn pending(&self) -> Option<&str> {
        self.pending.as_deref()
    }
}

/// What a reload changed: from [`Follower::reload`].
#[derive(Clone, Debug)]
pub struct Reloaded {
    version: String,
    reset: Vec<String>,
    kept: Vec<ShadowState>,
}

impl Reloaded {
    /// The version of the file now live: its SHA-256, in hex.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The policies whose algorithm or period changed: their callers' counts start
    /// afresh. A changed limit or burst is not here: callers keep what they used.
    pub fn reset_policies(&self) -> &[String] {
        &self.reset
    }

    /// The run-time shadow switches kept over what the new file says.
    pub fn kept_switches(&self) -> &[ShadowState] {
        &self.kept
    }
}

impl fmt::Debug for Follower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Follower")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_size: MAX_FILE_SIZE,
            timeout: READ_TIMEOUT,
            settle: SETTLE,
            clock: Arc::new(MonotonicClock::new()),
        }
    }
}

impl Follower {
    /// Reads the file at `path` (bounded as a reload is) and validates it, ready to be
    /// followed.
    ///
    /// # Errors
    ///
    /// When the file cannot be read within the bounds or is not valid.
    pub fn new(path: impl Into<PathBuf>) -> Result<Self, ConfigError> {
        let path = path.into();
        let bounds = Bounds::default();
        let reading = Arc::new(AtomicBool::new(false));
        let read = read_blocking(&reading, &path, &bounds)?;
        Ok(Self::from_file(path, read.file?))
    }

    /// Follows `file`, already read, at `path`.
    #[must_use]
    pub fn from_file(path: impl Into<PathBuf>, file: LimitsFile) -> Self {
        let path = path.into();
        let version = sha256(file.text.as_bytes());
        let loaded_at = SystemTime::now();
        tell_live(None, &version, loaded_at);
        Follower {
            live: Arc::new(Live {
                reading: Arc::new(AtomicBool::new(false)),
                state: watch::Sender::new(LiveConfig {
                    path: path.clone(),
                    version,
                    loaded_at,
                    reloads: 0,
                    failures: 0,
                    last_error: None,
                    pending: None,
                }),
            }),
            path,
            current: Arc::new(Mutex::new(file)),
            followers: Arc::new(Mutex::new(Vec::new())),
            bounds: Bounds::default(),
        }
    }

    /// Hands every valid new version of the file to `apply`, which puts it in force or
    /// refuses it (the running file then stays, and the reload fails with its error).
    ///
    /// Each reload calls what follows in the order they were added, and stops at the
    /// first refusal: add first what may refuse (a [`Reloader`](super::Reloader)'s
    /// layer is).
    pub fn follow(
        &self,
        apply: impl Fn(&LimitsFile) -> Result<(), ConfigError> + Send + Sync + 'static,
    ) {
        self.follow_with(Arc::new(move |_, file| {
            apply(file).map(|()| Changed::default())
        }));
    }

    /// [`follow`](Self::follow), telling what changed.
    pub(super) fn follow_with(&self, apply: Apply) {
        self.followers.lock().push(apply);
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `read` on the live limits file: the one the last good load or reload read.
    pub fn with_file<R>(&self, read: impl FnOnce(&LimitsFile) -> R) -> R {
        read(&self.current.lock())
    }

    /// The largest file a reload reads, in bytes (1 MiB unless set): a larger one is
    /// refused, the running file kept.
    #[must_use]
    pub fn max_file_size(mut self, bytes: u64) -> Self {
        self.bounds.max_size = bytes;
        self
    }

    /// How long a reload waits for the file to be read (5 s unless set): past it, the
    /// reload fails and the running file stays.
    #[must_use]
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.bounds.timeout = timeout;
        self
    }

    /// How long a file written in place must stay the same before the
    /// [watcher](Self::watch) applies it (1 s unless set). A file renamed into place is
    /// whole, and applied at once.
    #[must_use]
    pub fn settle(mut self, settle: Duration) -> Self {
        self.bounds.settle = settle;
        self
    }

    /// The clock [`settle`](Self::settle) is measured on (the process's monotonic clock
    /// unless set): a test's manual clock decides when a file has settled.
    #[must_use]
    pub fn settle_clock(mut self, clock: impl Clock) -> Self {
        self.bounds.clock = Arc::new(clock);
        self
    }

    /// Which file is live, and how its reloads went.
    #[must_use]
    pub fn live(&self) -> LiveConfig {
        self.live.state.borrow().clone()
    }

    /// What [`live`](Self::live) says, each time it changes: a reload applied or failed,
    /// a change the watcher waits to settle. Await `changed()` or `wait_for(..)` on it.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<LiveConfig> {
        self.live.state.subscribe()
    }

    /// Reads the file again and, if it is valid, hands it to what follows it. The file is
    /// read on a thread of its own, and this waits on a tokio timer at most the
    /// [`read_timeout`](Self::read_timeout).
    ///
    /// # Errors
    ///
    /// When the file cannot be read in time, is not valid, or what follows it refuses
    /// it: the running file stays.
    pub async fn reload(&self) -> Result<Reloaded, ConfigError> {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let read = match off_thread(&self.live.reading, &self.path, &self.bounds, sender) {
            Ok(()) => match tokio::time::timeout(self.bounds.timeout, receiver).await {
                Ok(Ok(read)) => read,
                Ok(Err(_)) => Err(gone(&self.path)),
                Err(_) => Err(timed_out(&self.path, self.bounds.timeout)),
            },
            Err(busy) => Err(busy),
        };
        self.apply(read)
    }

    /// Reads the file on a thread of its own, waiting for it on this thread at most the
    /// read timeout.
    pub(super) fn read_blocking(&self) -> Result<Read, ConfigError> {
        read_blocking(&self.live.reading, &self.path, &self.bounds)
    }

    /// Hands `read`'s file to what follows, if it is a valid file, and tells either way.
    ///
    /// A reload is told at info, a failure at warn.
    pub(super) fn apply(&self, read: Result<Read, ConfigError>) -> Result<Reloaded, ConfigError> {
        let mut current = self.current.lock();
        let reloaded = read.and_then(|read| {
            let file = read.file?;
            let mut changed = Changed::default();
            for apply in self.followers.lock().iter() {
                let Changed { reset, kept } = apply(&current, &file)?;
                changed.reset.extend(reset);
                changed.kept.extend(kept);
            }
            *current = file;
            Ok(Reloaded {
                version: read.version,
                reset: changed.reset,
                kept: changed.kept,
            })
        });
        self.live.state.send_modify(|live| {
            live.pending = None;
            match &reloaded {
                Ok(reloaded) => {
                    let loaded_at = SystemTime::now();
                    tell_live(Some(&live.version), &reloaded.version, loaded_at);
                    live.version.clone_from(&reloaded.version);
                    live.loaded_at = loaded_at;
                    live.reloads += 1;
                    live.last_error = None;
                    #[cfg(feature = "metrics")]
                    metrics::counter!(tollway_core::metric::CONFIG_RELOADS.name).increment(1);
                    tracing::info!(
                        path = %self.path.display(),
                        version = short(&reloaded.version),
                        "rate limits reloaded"
                    );
                }
                Err(error) => {
                    live.failures += 1;
                    live.last_error = Some(error.to_string());
                    #[cfg(feature = "metrics")]
                    metrics::counter!(tollway_core::metric::CONFIG_RELOAD_ERRORS.name).increment(1);
                    tracing::warn!(%error, "rate limits not reloaded; the running limits stay");
                }
            }
        });
        reloaded
    }
}

/// Tells the metrics recorder which file is live (its version, `was` no longer) and
/// since when.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
fn tell_live(was: Option<&str>, version: &str, loaded_at: SystemTime) {
    #[cfg(feature = "metrics")]
    {
        if let Some(was) = was.filter(|was| *was != version) {
            metrics::gauge!(tollway_core::metric::CONFIG_INFO.name, "version" => was.to_owned())
                .set(0.0);
        }
        metrics::gauge!(tollway_core::metric::CONFIG_INFO.name, "version" => version.to_owned())
            .set(1.0);
        let unix = loaded_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        metrics::gauge!(tollway_core::metric::CONFIG_LOADED.name).set(unix.as_secs_f64());
    }
}

/// Reads the file at `path` on a thread of its own, waiting for it on this thread at
/// most `bounds`' timeout.
fn read_blocking(
    reading: &Arc<AtomicBool>,
    path: &Path,
    bounds: &Bounds,
) -> Result<Read, ConfigError> {
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    off_thread(reading, path, bounds, sender)?;
    match receiver.recv_timeout(bounds.timeout) {
        Ok(read) => read,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(timed_out(path, bounds.timeout)),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(gone(path)),
    }
}

/// Where a read done off the caller's thread goes.
trait Deliver: Send + 'static {
    fn deliver(self, read: Result<Read, ConfigError>);
}

impl Deliver for std::sync::mpsc::SyncSender<Result<Read, ConfigError>> {
    fn deliver(self, read: Result<Read, ConfigError>) {
        // The caller may have stopped waiting: then nobody wants it.
        let _ = self.send(read);
    }
}

impl Deliver for tokio::sync::oneshot::Sender<Result<Read, ConfigError>> {
    fn deliver(self, read: Result<Read, ConfigError>) {
        let _ = self.send(read);
    }
}

/// Starts reading `path` on a thread of its own, for `to`. One read at a time: while
/// one is under way (a file that blocks), another is refused at once, so that a stuck
/// read holds one thread, not one per reload.
fn off_thread(
    reading: &Arc<AtomicBool>,
    path: &Path,
    bounds: &Bounds,
    to: impl Deliver,
) -> Result<(), ConfigError> {
    let max = bounds.max_size;
    let owned = path.to_path_buf();
    on_a_thread(reading, path, move || read_file(&owned, max), to)
}

/// Runs `work` on a thread of its own, for `to`, unless a previous one is still running.
fn on_a_thread(
    reading: &Arc<AtomicBool>,
    path: &Path,
    work: impl FnOnce() -> Result<Read, ConfigError> + Send + 'static,
    to: impl Deliver,
) -> Result<(), ConfigError> {
    if reading.swap(true, Ordering::AcqRel) {
        return Err(ConfigError::new(format!(
            "{}: the last read of the limits file has not finished (is it a file on a \
             stalled mount?): no other read starts until it does; the running limits stay",
            path.display()
        )));
    }
    let done = Arc::clone(reading);
    std::thread::Builder::new()
        .name("tollway-limits-read".to_owned())
        .spawn(move || {
            let read = work();
            done.store(false, Ordering::Release);
            to.deliver(read);
        })
        .map(drop)
        .map_err(|e| {
            reading.store(false, Ordering::Release);
            ConfigError::new(format!(
                "cannot start a thread to read the limits file: {e}"
            ))
        })
}

fn timed_out(path: &Path, timeout: Duration) -> ConfigError {
    ConfigError::new(format!(
        "{}: the limits file was not read within {timeout:?}; the running limits stay",
        path.display()
    ))
}

fn gone(path: &Path) -> ConfigError {
    ConfigError::new(format!(
        "{}: the thread reading the limits file ended without an answer; the running \
         limits stay",
        path.display()
    ))
}

/// Reads and validates the file at `path`: at most `max` bytes of a regular file.
pub(super) fn read_file(path: &Path, max: u64) -> Result<Read, ConfigError> {
    let bytes = read_bytes(path, max)?;
    let version = sha256(&bytes);
    let file = LimitsFile::from_bytes(&path.display().to_string(), &bytes);
    Ok(Read { version, file })
}

/// The bytes of the regular file at `path`, at most `max` of them.
pub(super) fn read_bytes(path: &Path, max: u64) -> Result<Vec<u8>, ConfigError> {
    let shown = path.display();
    let cannot =
        |e: std::io::Error| ConfigError::new(format!("{shown}: cannot read the limits file: {e}"));
    let not_a_file = || {
        ConfigError::new(format!(
            "{shown}: not a regular file (a FIFO or a device would block the read, or never \
             end): point the path at the limits file itself"
        ))
    };
    let too_big = |size: u64| {
        ConfigError::new(format!(
            "{shown}: the limits file is {size} bytes, over the {max} a reload reads: keep \
             many API keys in a tier lookup rather than in [tiers], or raise \
             Reloader::max_file_size"
        ))
    };
    // Refused before it is opened: opening a FIFO blocks until something writes to it.
    if !std::fs::metadata(path).map_err(cannot)?.is_file() {
        return Err(not_a_file());
    }
    let file = std::fs::File::open(path).map_err(cannot)?;
    let metadata = file.metadata().map_err(cannot)?;
    if !metadata.is_file() {
        return Err(not_a_file());
    }
    if metadata.len() > max {
        return Err(too_big(metadata.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    // A file growing while it is read still stops one byte past the bound.
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    let read = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
    if read > max {
        return Err(too_big(read));
    }
    Ok(bytes)
}

/// The SHA-256 of `bytes`, in hex.
fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut hex, byte| {
            use fmt::Write as _;
            // Writing to a String cannot fail.
            let _ = write!(hex, "{byte:02x}");
            hex
        })
}

/// A version, shortened for a log line.
pub(super) fn short(version: &str) -> &str {
    version.get(..12).unwrap_or(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("tollway-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const VALID: &str = "[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1m\"\n";

    /// A read that hangs fails at the timeout, and holds the only reading thread: the
    /// next read is refused at once, until the hung one ends.
    #[test]
    fn a_read_that_hangs_fails_at_the_timeout_and_the_next_waits_for_it() {
        let reading = Arc::new(AtomicBool::new(false));
        let path = Path::new("limits.toml");
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let hang = move || {
            let _ = hung.recv();
            read_file(Path::new("/nonexistent/limits.toml"), 10)
        };
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        on_a_thread(&reading, path, hang, sender).unwrap();
        let waited = std::time::Instant::now();
        assert!(receiver.recv_timeout(Duration::from_millis(50)).is_err());
        assert!(waited.elapsed() < Duration::from_secs(5));
        let (sender, _receiver) = std::sync::mpsc::sync_channel(1);
        let busy = on_a_thread(&reading, path, || read_file(path, 10), sender).unwrap_err();
        assert!(busy.to_string().contains("has not finished"), "{busy}");

        release.send(()).unwrap();
        // The hung read ends and hands in its answer; then reads start again.
        assert!(
            receiver
                .recv_timeout(Duration::from_secs(10))
                .unwrap()
                .is_err()
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while reading.load(Ordering::Acquire) {
            assert!(std::time::Instant::now() < deadline);
            std::thread::yield_now();
        }
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        on_a_thread(&reading, path, || read_file(path, 10), sender).unwrap();
        assert!(receiver.recv_timeout(Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn a_file_over_the_bound_is_refused_before_it_is_read() {
        let dir = Dir::new("bound");
        let path = dir.0.join("limits.toml");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(64 << 20).unwrap();
        let err = read_bytes(&path, MAX_FILE_SIZE).unwrap_err().to_string();
        assert!(err.contains("67108864 bytes, over the 1048576"), "{err}");
        assert!(err.contains("max_file_size"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_utf8_is_refused_at_its_line_and_column() {
        let dir = Dir::new("utf8");
        let path = dir.0.join("limits.toml");
        let mut bytes = VALID.as_bytes().to_vec();
        bytes.extend_from_slice(b"# caf\xe9\n");
        std::fs::write(&path, &bytes).unwrap();
        let read = read_file(&path, MAX_FILE_SIZE).unwrap();
        let err = read.file.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}:8:6: byte 0xe9 is not UTF-8", path.display())),
            "{err}"
        );
    }

    #[test]
    fn the_version_is_the_files_sha256() {
        assert_eq!(
            sha256(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
