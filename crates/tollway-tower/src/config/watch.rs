//! Watching a limits file: the path, every link on the way to the file (a link into
//! another directory, a Kubernetes ConfigMap's `..data`), and the file itself; a change
//! applied once the file is whole.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use notify::event::{EventKind, ModifyKind, RenameMode};
use notify::{RecommendedWatcher, RecursiveMode, Watcher as _};
use tollway_core::ConfigError;

use super::follow::{Follower, short};

/// How long a burst of events must have stopped before the file is read.
const QUIET: Duration = Duration::from_millis(50);

/// How many symbolic links a path may go through (Linux's own bound).
const MAX_LINKS: usize = 40;

/// Watches a limits file for [`Follower::watch`]; dropping it stops the watching.
pub struct Watcher {
    stop: Sender<Message>,
}

impl fmt::Debug for Watcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // The watching thread may have ended already (nothing to stop then).
        let _ = self.stop.send(Message::Stop);
    }
}

/// What the watching thread hears.
enum Message {
    Event(notify::Event),
    Stop,
}

impl Follower {
    /// Reloads whenever the file changes, until the returned watcher is dropped.
    ///
    /// It watches the path's directory, so an editor that replaces the file is seen. It
    /// also watches every symbolic link on the way to the file, with the directory the
    /// file is in. So a link into another directory is followed, and followed again when
    /// it changes. So is a Kubernetes ConfigMap, whose `..data` link is swapped by a
    /// rename.
    ///
    /// A file renamed into place (an atomic save, a ConfigMap update) is whole: it is
    /// applied once the burst of events has stopped. A file written in place is applied
    /// only once its bytes have stayed the same for [`settle`](Self::settle). It is read
    /// again until they do. So a file half written is never loaded, whatever the writer's
    /// pauses under that time. A change back to the live file is no reload.
    ///
    /// # Errors
    ///
    /// When the operating system's file watcher cannot be set up.
    pub fn watch(&self) -> Result<Watcher, ConfigError> {
        let (events, heard) = std::sync::mpsc::channel();
        let sender = events.clone();
        let mut notifier =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Reading the file (a reload does) is not a change.
                if let Ok(event) = event
                    && !event.kind.is_access()
                {
                    let _ = sender.send(Message::Event(event));
                }
            })
            .map_err(|e| ConfigError::new(format!("cannot watch {}: {e}", self.path.display())))?;
        let paths = Paths::new(&self.path);
        for dir in &paths.dirs {
            notifier
                .watch(dir, RecursiveMode::NonRecursive)
                .map_err(|e| ConfigError::new(format!("cannot watch {}: {e}", dir.display())))?;
        }
        paths.tell("watching");
        let follower = self.clone();
        std::thread::Builder::new()
            .name("tollway-limits-watch".to_owned())
            .spawn(move || follower.watching(notifier, paths, &heard))
            .map_err(|e| ConfigError::new(format!("cannot start the file watcher: {e}")))?;
        Ok(Watcher { stop: events })
    }

    /// The watching thread: waits for the file's events (or, while a change settles, for
    /// the next look at it), reads it, and applies it once it is whole.
    fn watching(
        &self,
        mut notifier: RecommendedWatcher,
        mut paths: Paths,
        heard: &Receiver<Message>,
    ) {
        let settle = self.bounds.settle;
        let tick = (settle / 5).clamp(Duration::from_millis(10), Duration::from_millis(200));
        let settle_us = u64::try_from(settle.as_micros()).unwrap_or(u64::MAX);
        // What was read last, while it settles, and when it was first read.
        let mut pending: Option<(Result<String, String>, u64)> = None;
        loop {
            let first = if pending.is_some() {
                heard.recv_timeout(tick)
            } else {
                heard.recv().map_err(|_| RecvTimeoutError::Disconnected)
            };
            let mut burst = Vec::new();
            match first {
                Ok(Message::Event(event)) => burst.push(event),
                Ok(Message::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                // The next look at a change settling.
                Err(RecvTimeoutError::Timeout) => {}
            }
            if !burst.is_empty() {
                loop {
                    match heard.recv_timeout(QUIET) {
                        Ok(Message::Event(event)) => burst.push(event),
                        Ok(Message::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                        Err(RecvTimeoutError::Timeout) => break,
                    }
                }
            }
            // Events on the paths before and after the links are followed again are ours;
            // whether the file was renamed into place, only the paths after say.
            let before = paths.clone();
            paths.refresh(&mut notifier);
            let ours = burst
                .iter()
                .any(|event| before.is_ours(event) || paths.is_ours(event));
            if !burst.is_empty() && !ours {
                continue;
            }
            let renamed = burst
                .iter()
                .rev()
                .find_map(|e| paths.renamed_in(e))
                .unwrap_or(false);
            let read = self.read_blocking();
            let seen = match &read {
                Ok(read) => Ok(read.version.clone()),
                Err(error) => Err(error.to_string()),
            };
            if seen.as_ref().ok() == Some(&self.live().version().to_owned()) {
                // Back to (or still) the live file: nothing to reload.
                pending = None;
                self.set_pending(None);
                continue;
            }
            let now = self.bounds.clock.now_micros();
            let settled = pending.as_ref().is_some_and(|(was, since)| {
                *was == seen && now.saturating_sub(*since) >= settle_us
            });
            if renamed || settled || settle.is_zero() {
                pending = None;
                // Told (logged, counted) in apply.
                let _ = self.apply(read);
            } else if pending.as_ref().is_none_or(|(was, _)| *was != seen) {
                if let Ok(version) = &seen {
                    tracing::debug!(
                        version = short(version),
                        "the limits file changed: applied once it has stayed so for {settle:?}"
                    );
                }
                self.set_pending(seen.as_ref().ok().cloned());
                pending = Some((seen, now));
            }
        }
    }
}

impl Follower {
    /// Tells subscribers of a change waiting to settle (`None`: none any more), if that
    /// is news.
    fn set_pending(&self, pending: Option<String>) {
        self.live.state.send_if_modified(|live| {
            let news = live.pending != pending;
            live.pending = pending;
            news
        });
    }
}

/// The paths a limits file's path goes through: each symbolic link on the way, the file
/// it ends at, and the directories to watch for them.
#[derive(Clone, PartialEq)]
struct Paths {
    /// The path as given.
    path: PathBuf,
    /// Each link on the way, then the file.
    chain: Vec<PathBuf>,
    dirs: BTreeSet<PathBuf>,
}

impl Paths {
    fn new(path: &Path) -> Self {
        let chain = chain(path);
        let dirs = chain
            .iter()
            .filter_map(|p| p.parent())
            .map(Path::to_path_buf)
            .collect();
        Paths {
            path: path.to_path_buf(),
            chain,
            dirs,
        }
    }

    /// Follows the links again, and watches what they lead to now.
    fn refresh(&mut self, notifier: &mut RecommendedWatcher) {
        let now = Paths::new(&self.path);
        if now == *self {
            return;
        }
        for dir in now.dirs.difference(&self.dirs) {
            if let Err(error) = notifier.watch(dir, RecursiveMode::NonRecursive) {
                tracing::warn!(%error, dir = %dir.display(), "cannot watch the limits file's directory");
            }
        }
        for dir in self.dirs.difference(&now.dirs) {
            // A directory removed (a ConfigMap's old data) is no longer watched anyway.
            let _ = notifier.unwatch(dir);
        }
        *self = now;
        self.tell("now watching");
    }

    /// Logs what is watched, at info.
    fn tell(&self, what: &str) {
        let file = self.chain.last().map_or(Path::new(""), PathBuf::as_path);
        tracing::info!(
            path = %self.path.display(),
            file = %file.display(),
            links = self.chain.len().saturating_sub(1),
            "{what} the limits file"
        );
    }

    /// Whether `event` touches the file or a link on the way to it.
    fn is_ours(&self, event: &notify::Event) -> bool {
        event.paths.iter().any(|p| self.chain.contains(p))
    }

    /// Whether `event` renamed something onto the file or a link on the way (`Some(true)`),
    /// changed one of them otherwise (`Some(false)`), or is not ours (`None`).
    fn renamed_in(&self, event: &notify::Event) -> Option<bool> {
        let onto = match event.kind {
            EventKind::Modify(ModifyKind::Name(RenameMode::To)) => event.paths.first(),
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => event.paths.get(1),
            _ => None,
        };
        if onto.is_some_and(|p| self.chain.contains(p)) {
            Some(true)
        } else {
            self.is_ours(event).then_some(false)
        }
    }
}

/// A part of a path, owned.
enum Part {
    /// Where an absolute path starts: a Windows prefix, or the root.
    Start(OsString),
    Up,
    Name(OsString),
}

fn parts(path: &Path) -> Vec<Part> {
    path.components()
        .filter_map(|c| match c {
            Component::Prefix(_) | Component::RootDir => {
                Some(Part::Start(c.as_os_str().to_owned()))
            }
            Component::CurDir => None,
            Component::ParentDir => Some(Part::Up),
            Component::Normal(name) => Some(Part::Name(name.to_owned())),
        })
        .collect()
}

/// Each symbolic link `path` goes through (of the file, or of a directory on the way),
/// then the file it ends at: all absolute, as the links say (not canonicalised further).
fn chain(path: &Path) -> Vec<PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map_or_else(|_| path.to_path_buf(), |cwd| cwd.join(path))
    };
    let mut todo = parts(&absolute);
    todo.reverse();
    let mut at = PathBuf::new();
    let mut links = Vec::new();
    while let Some(part) = todo.pop() {
        match part {
            Part::Start(start) => at.push(start),
            Part::Up => {
                at.pop();
            }
            Part::Name(name) => {
                let next = at.join(&name);
                match std::fs::read_link(&next) {
                    // A link's target is relative to its directory, `at`.
                    Ok(target) if links.len() < MAX_LINKS => {
                        links.push(next);
                        todo.extend(parts(&target).into_iter().rev());
                    }
                    _ => at = next,
                }
            }
        }
    }
    links.push(at);
    links
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_chain_follows_links_to_files_and_directories() {
        let dir = std::env::temp_dir().join(format!("tollway-chain-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("..2026_01")).unwrap();
        std::fs::write(dir.join("..2026_01/limits.toml"), "").unwrap();
        std::os::unix::fs::symlink("..2026_01", dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/limits.toml", dir.join("limits.toml")).unwrap();
        let chain = chain(&dir.join("limits.toml"));
        std::fs::remove_dir_all(&dir).unwrap();
        // The tmp directory may itself be reached through a link.
        let tail: Vec<_> = chain[chain.len() - 3..].to_vec();
        assert!(
            tail[0].ends_with("limits.toml")
                && tail[0]
                    .parent()
                    .unwrap()
                    .ends_with(dir.file_name().unwrap()),
            "{chain:?}"
        );
        assert!(tail[1].ends_with("..data"), "{chain:?}");
        assert!(tail[2].ends_with("..2026_01/limits.toml"), "{chain:?}");
    }
}
