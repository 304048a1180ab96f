//! Watches the CNI config and bin directories with inotify and reports "something changed".
//!
//! In: the directories to watch. Out: an `Instant` on a channel for every relevant change,
//! which the verifier coalesces into one re-verification.
//!
//! - The config dir is watched recursively, so CNI 1.1 drop-in plugin directories count.
//! - A directory that does not exist yet (a primary CNI not installed) is waited for by
//!   watching its nearest existing ancestor; [`FsWatch::ensure`] moves the watch onto the
//!   directory once it appears, and back to an ancestor if it is removed.
//! - Open events are dropped: the verifier opens configs and runs plugin binaries itself, and
//!   must not wake itself up.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

struct Target {
    dir: PathBuf,
    mode: RecursiveMode,
    /// What is actually watched now: the dir itself, an ancestor, or nothing.
    watching: Option<PathBuf>,
}

/// The live inotify watches.
pub struct FsWatch {
    watcher: RecommendedWatcher,
    targets: Vec<Target>,
}

/// True for events that can change the verdict.
fn relevant(event: &Event, dirs: &[PathBuf]) -> bool {
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    // Events from an ancestor watch matter only on the way to a watched dir; events without
    // paths (queue overflow, rescan) always matter.
    event.paths.is_empty()
        || event
            .paths
            .iter()
            .any(|p| dirs.iter().any(|d| p.starts_with(d) || d.starts_with(p)))
}

impl FsWatch {
    /// Starts watching `conf_dir` (recursively) and `bin_dirs`; changes are sent on `tx`.
    pub fn start(
        conf_dir: &Path,
        bin_dirs: &[PathBuf],
        tx: mpsc::UnboundedSender<Instant>,
    ) -> notify::Result<Self> {
        let dirs: Arc<Vec<PathBuf>> = Arc::new(
            std::iter::once(conf_dir.to_path_buf())
                .chain(bin_dirs.iter().cloned())
                .collect(),
        );
        let filter = dirs.clone();
        let watcher = notify::recommended_watcher(move |res: notify::Result<Event>| match res {
            Ok(event) if relevant(&event, &filter) => {
                let _ = tx.send(Instant::now());
            }
            Ok(_) => {}
            Err(e) => {
                // An inotify error (e.g. queue overflow) may hide a change: re-verify.
                tracing::warn!(error = %e, "inotify error; re-verifying");
                let _ = tx.send(Instant::now());
            }
        })?;
        let mut targets = vec![Target {
            dir: conf_dir.to_path_buf(),
            mode: RecursiveMode::Recursive,
            watching: None,
        }];
        targets.extend(bin_dirs.iter().map(|d| Target {
            dir: d.clone(),
            mode: RecursiveMode::NonRecursive,
            watching: None,
        }));
        let mut w = Self { watcher, targets };
        w.ensure();
        Ok(w)
    }

    /// Puts each watch on its directory if it exists now, else on its nearest existing
    /// ancestor. Cheap when nothing changed; called after every batch of events.
    pub fn ensure(&mut self) {
        for t in &mut self.targets {
            let want = if t.dir.is_dir() {
                Some((t.dir.clone(), t.mode))
            } else {
                t.dir
                    .ancestors()
                    .skip(1)
                    .find(|a| a.is_dir())
                    .map(|a| (a.to_path_buf(), RecursiveMode::NonRecursive))
            };
            let want_path = want.as_ref().map(|(p, _)| p.clone());
            // The inotify watch of a dir that was deleted and re-created is gone, so re-add
            // the watch whenever the dir is (again) the target, not only when it changed.
            if want_path == t.watching && want_path.as_deref() != Some(t.dir.as_path()) {
                continue;
            }
            if let Some(old) = t.watching.take() {
                let _ = self.watcher.unwatch(&old);
            }
            if let Some((path, mode)) = want {
                match self.watcher.watch(&path, mode) {
                    Ok(()) => t.watching = Some(path),
                    Err(e) => {
                        tracing::warn!(dir = %t.dir.display(), watch = %path.display(), error = %e, "cannot watch")
                    }
                }
            }
        }
    }

    /// Whether every directory is watched directly (not through an ancestor).
    pub fn all_direct(&self) -> bool {
        self.targets
            .iter()
            .all(|t| t.watching.as_deref() == Some(t.dir.as_path()))
    }
}
