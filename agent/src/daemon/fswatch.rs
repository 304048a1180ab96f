//! Watches the CNI config and bin directories (and the node proxy's socket directory) with
//! inotify and reports "something changed".
//!
//! In: the directories to watch. Out: an [`FsEvent`] on a channel for every relevant change
//! (when, which path, what it says: `meshgate_core::cni::burst::Change`), which the verifier
//! coalesces into one re-verification; and, on the inotify thread, each path created, closed
//! after writing, renamed into place or chmod'ed, to a [`Notice`] hook (the pre-prober, which
//! keeps only binaries directly in a bin dir).
//!
//! - The config dir is watched recursively, so CNI 1.1 drop-in plugin directories count.
//! - A directory that does not exist yet (a primary CNI not installed) is waited for by
//!   watching its nearest existing ancestor; [`FsWatch::ensure`] moves the watch onto the
//!   directory once it appears, and back to an ancestor if it is removed.
//! - A Multus `clusterNetwork` file outside the config dir (the verdict names it) is
//!   followed too: its directory is watched, so editing the delegate re-verifies at once.
//! - Open events are dropped: the verifier opens configs and runs plugin binaries itself, and
//!   must not wake itself up.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use meshgate_core::cni::burst::Change;
use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// One relevant change in the watched directories.
#[derive(Clone, Debug)]
pub struct FsEvent {
    /// When it was seen.
    pub at: Instant,
    /// The path it is about; `None` for an inotify error or an overflow.
    pub path: Option<PathBuf>,
    /// What it says about the path.
    pub change: Change,
}

/// Called on the inotify thread with each path that may be a new or changed binary; must
/// not block.
pub type Notice = Arc<dyn Fn(&Path) + Send + Sync>;

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
    /// The directories whose events count (shared with the inotify callback).
    dirs: Arc<RwLock<Vec<PathBuf>>>,
    /// How many of `targets` are the fixed ones (config dir, bin dirs); a followed delegate
    /// directory comes after them.
    fixed: usize,
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

/// What an inotify event (as `notify` reports it) says, and about which path: for a rename
/// with both ends known (`Name(Both)`), the destination.
fn change_of(event: &Event) -> (Option<PathBuf>, Change) {
    let path = event.paths.last().cloned();
    let change = match event.kind {
        EventKind::Create(CreateKind::Folder) => Change::CreatedComplete,
        // A socket or a symlink is whole when it appears; a regular file may be written next.
        EventKind::Create(_) => match path.as_deref().map(std::fs::symlink_metadata) {
            Some(Ok(m)) if !m.file_type().is_file() => Change::CreatedComplete,
            _ => Change::Created,
        },
        EventKind::Modify(ModifyKind::Data(_)) => Change::Written,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => Change::ClosedWrite,
        EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => Change::MovedIn,
        EventKind::Modify(ModifyKind::Name(RenameMode::From)) => Change::MovedOut,
        EventKind::Modify(ModifyKind::Metadata(_)) => Change::Attrib,
        EventKind::Remove(_) => Change::Removed,
        _ => Change::Unknown,
    };
    (path, change)
}

/// Hands `path` to the pre-prober when the change may have left a new or changed binary.
fn notice_binary(notice: &Notice, path: Option<&Path>, change: Change) {
    if let Some(p) = path
        && matches!(
            change,
            Change::Created | Change::ClosedWrite | Change::MovedIn | Change::Attrib
        )
    {
        notice(p);
    }
}

impl FsWatch {
    /// Starts watching `conf_dir` (recursively) and `bin_dirs` (flat: the plugin dirs, and any
    /// other directory the verdict reads, such as the node proxy's socket directory); changes
    /// are sent on `tx`.
    pub fn start(
        conf_dir: &Path,
        bin_dirs: &[PathBuf],
        tx: mpsc::UnboundedSender<FsEvent>,
        notice: Notice,
    ) -> notify::Result<Self> {
        let dirs: Arc<RwLock<Vec<PathBuf>>> = Arc::new(RwLock::new(
            std::iter::once(conf_dir.to_path_buf())
                .chain(bin_dirs.iter().cloned())
                .collect(),
        ));
        let filter = dirs.clone();
        let watcher = notify::recommended_watcher(move |res: notify::Result<Event>| match res {
            // A poisoned lock (a panic elsewhere) counts every event: re-verifying is safe.
            Ok(event) if filter.read().map_or(true, |d| relevant(&event, &d)) => {
                let at = Instant::now();
                // A rename reported with both ends also takes the file away from its old name
                // (a temporary file of an atomic write), whether or not `From` came alone.
                if let (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), [from, _]) =
                    (event.kind, event.paths.as_slice())
                {
                    let path = Some(from.clone());
                    let _ = tx.send(FsEvent {
                        at,
                        path,
                        change: Change::MovedOut,
                    });
                }
                let (path, change) = change_of(&event);
                notice_binary(&notice, path.as_deref(), change);
                let _ = tx.send(FsEvent { at, path, change });
            }
            Ok(_) => {}
            Err(e) => {
                // An inotify error (e.g. queue overflow) may hide a change: re-verify, once
                // the directories have gone quiet.
                tracing::warn!(error = %e, "inotify error; re-verifying");
                let _ = tx.send(FsEvent {
                    at: Instant::now(),
                    path: None,
                    change: Change::Unknown,
                });
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
        let fixed = targets.len();
        let mut w = Self {
            watcher,
            targets,
            dirs,
            fixed,
        };
        w.ensure();
        Ok(w)
    }

    /// Follows the directory of the delegate file the last verdict read (a Multus
    /// `clusterNetwork` path), unless the recursive config-dir watch already covers it;
    /// `None` stops following. Cheap when it did not change.
    pub fn follow_delegate(&mut self, file: Option<&Path>) {
        let conf_dir = self.targets[0].dir.clone();
        let want = file
            .and_then(Path::parent)
            .filter(|d| !d.starts_with(&conf_dir))
            .map(Path::to_path_buf);
        let have = self.targets.get(self.fixed).map(|t| t.dir.clone());
        if want == have {
            return;
        }
        if have.is_some()
            && let Some(w) = self.targets.pop().and_then(|old| old.watching)
        {
            let _ = self.watcher.unwatch(&w);
        }
        if let Ok(mut dirs) = self.dirs.write() {
            dirs.truncate(self.fixed);
            dirs.extend(want.iter().cloned());
        }
        if let Some(dir) = want {
            // Recursive: Multus loads the file's drop-in plugins from a subdirectory.
            self.targets.push(Target {
                dir,
                mode: RecursiveMode::Recursive,
                watching: None,
            });
        }
        self.ensure();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether an event arrives within a second.
    fn woke(rx: &mut mpsc::UnboundedReceiver<FsEvent>) -> bool {
        for _ in 0..100 {
            if rx.try_recv().is_ok() {
                // The rest of the burst (modify, close-write) is not a second wake.
                std::thread::sleep(Duration::from_millis(200));
                while rx.try_recv().is_ok() {}
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_delegate_file_outside_the_conf_dir_is_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let conf = tmp.path().join("net.d");
        let other = tmp.path().join("multus/net.d");
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let delegate = other.join("default.conflist");
        std::fs::write(&delegate, b"{}").unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut w = FsWatch::start(&conf, &[], tx, Arc::new(|_: &Path| {})).unwrap();
        std::fs::write(&delegate, b"{ }").unwrap();
        assert!(!woke(&mut rx), "not followed yet");
        w.follow_delegate(Some(&delegate));
        std::fs::write(&delegate, b"{  }").unwrap();
        assert!(
            woke(&mut rx),
            "an edit of the followed delegate wakes the verifier"
        );
        // Still watching the config dir; a delegate inside it needs no extra watch.
        w.follow_delegate(Some(&conf.join("10-calico.conflist")));
        assert_eq!(w.targets.len(), 1);
        woke(&mut rx); // what removing the watch itself reports

        std::fs::write(&delegate, b"{}").unwrap();
        assert!(!woke(&mut rx), "no longer followed");
        std::fs::write(conf.join("10-calico.conflist"), b"{}").unwrap();
        assert!(woke(&mut rx));
    }
}
